"""Adaptive draft length for the n-gram proposer (``"draft_length": "adaptive"``).

How many drafts pay depends on two things that change at run time: how often drafts
are accepted (the workload) and what each extra verification row costs (the kernel, the
batch, the thread count: on one stream a row costs ~8-14% of a one-row step up to the
decode-sized kernels' 8 rows, then the step jumps to the prefill path). The chooser
keeps both as measured:

- acceptance by draft position: for each position j, how often a draft that reached j
  (the ones before it accepted) was accepted, counted from what each request's next
  tokens turned out to be (decayed, so the estimate follows the workload); the expected
  tokens from k drafts are 1 + sum over j <= k of the product of those rates;
- step time by the step's rows: the wall time from one step's end to the next's (the
  whole engine step, its Python included), for steps of decodes and verifications only,
  the median of the last few at each row count;

and picks, for the requests whose match is longer than one token, the one k (at most
``num_speculative_tokens``) that maximises expected tokens per second of step. A row
count not timed yet is interpolated between the timed ones around it (past the largest:
a fitted per-row cost, a little optimistic), and every 8th choice proposes one draft more
than the best, so the chooser keeps timing the next row count up. Tokens are
unaffected: drafts only change how many positions one step verifies.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque

# Acceptance estimates start at this rate with this weight in pseudo-observations.
PRIOR_RATE = 0.8
PRIOR_WEIGHT = 4.0
# Each observation shrinks the older counts by this factor (a ~50-verification memory).
DECAY = 0.98
# Step times kept per row count; their median is the estimate.
TIMES_KEPT = 9
# Past the largest timed row count, a row costs at least this fraction of the smallest
# timed step (a little optimistic: larger counts get tried, then timed).
UNMEASURED_ROW_COST = 0.05
# Every this many choices, one draft more than the best (the next row count gets timed).
EXPLORE_EVERY = 8


class DraftLengthChooser:
    def __init__(self, max_drafts: int) -> None:
        self.max_drafts = max_drafts
        # Decayed counts by draft position (index j - 1): reached, accepted.
        self.reached = [0.0] * max_drafts
        self.accepted = [0.0] * max_drafts
        self.times: dict[int, deque[float]] = {}
        self.medians: dict[int, float] = {}  # of `times`, by row count
        self.rows: list[int] = []  # the timed row counts, ascending
        self._row_cost: float | None = None  # fitted per-row cost (None: to recompute)
        self.num_choices = 0

    # ------------------------------------------------------------- observations
    def observe_verification(self, drafts: list[int], new_tokens: list[int]) -> None:
        """A request proposed `drafts`; `new_tokens` is what the next step gave it. The
        drafts equal to its first tokens were accepted; the one after them (if a token
        followed in its place) rejected. A request cut short (its last new token equal to
        a draft: a stop or max_tokens) tells nothing past its tokens."""
        if not drafts or not new_tokens:
            return
        m = 0
        while m < len(drafts) and m < len(new_tokens) and drafts[m] == new_tokens[m]:
            m += 1
        rejected = m < len(drafts) and m < len(new_tokens)
        upto = min(m + rejected, self.max_drafts)
        if not upto:
            return
        for j in range(self.max_drafts):
            self.reached[j] *= DECAY
            self.accepted[j] *= DECAY
        for j in range(upto):
            self.reached[j] += 1.0
            self.accepted[j] += 1.0 if j < m else 0.0

    def observe_step(self, num_rows: int, seconds: float) -> None:
        """The wall time of a step of `num_rows` rows, all decodes or verifications."""
        q = self.times.get(num_rows)
        if q is None:
            q = self.times[num_rows] = deque(maxlen=TIMES_KEPT)
            bisect.insort(self.rows, num_rows)
        q.append(seconds)
        self.medians[num_rows] = statistics.median(q)
        self._row_cost = None

    # ----------------------------------------------------------------- estimates
    def acceptance(self, j: int) -> float:
        """Estimated chance that draft j (1-based) is accepted when the ones before were."""
        r, a = self.reached[j - 1], self.accepted[j - 1]
        return (a + PRIOR_RATE * PRIOR_WEIGHT) / (r + PRIOR_WEIGHT)

    def expected_accepted(self, k: int) -> float:
        """Expected accepted drafts out of k."""
        total, survive = 0.0, 1.0
        for j in range(1, k + 1):
            survive *= self.acceptance(j)
            total += survive
        return total

    def step_time(self, num_rows: int) -> float | None:
        """Estimated seconds of a step of `num_rows` rows (None: nothing timed): the
        median where timed, else linear between the timed counts around it; past the
        largest, that one's time plus the fitted cost of a row (at least
        UNMEASURED_ROW_COST of the smallest step: a little optimistic)."""
        rows, known = self.rows, self.medians
        if not rows:
            return None
        if num_rows in known:
            return known[num_rows]
        i = bisect.bisect_left(rows, num_rows)
        if i == 0:  # fewer rows than any timed: no cheaper than the smallest
            return known[rows[0]]
        lo = rows[i - 1]
        if i < len(rows):
            hi = rows[i]
            return known[lo] + (known[hi] - known[lo]) * (num_rows - lo) / (hi - lo)
        if self._row_cost is None:
            floor = UNMEASURED_ROW_COST * known[rows[0]]
            self._row_cost = max(_slope(rows, [known[r] for r in rows]), floor)
        return known[lo] + self._row_cost * (num_rows - lo)

    # -------------------------------------------------------------------- choice
    def choose(self, base_rows: int, base_tokens: float, num_long: int) -> int:
        """Drafts for each of `num_long` requests with a multi-token match, given a step
        of `base_rows` rows (every request's own row, other drafts) that yields
        `base_tokens` tokens without them: the k maximising tokens per second (every
        EXPLORE_EVERY-th choice one more, when allowed, so the row count above gets
        timed too)."""
        if num_long == 0:
            return 0
        if self.step_time(base_rows) is None:
            return self.max_drafts  # nothing measured yet: the configured number
        best_k, best_rate = 0, -1.0
        for k in range(self.max_drafts + 1):
            t = self.step_time(base_rows + num_long * k)
            assert t is not None
            rate = (base_tokens + num_long * self.expected_accepted(k)) / max(t, 1e-9)
            if rate > best_rate * (1 + 1e-9):
                best_k, best_rate = k, rate
        self.num_choices += 1
        if self.num_choices % EXPLORE_EVERY == 0 and best_k < self.max_drafts:
            return best_k + 1
        return best_k


def _slope(xs: list[int], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (0.0 with fewer than two points)."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
