"""Each step's token masks, filled on a helper thread while the forward pass runs.

The masks of step N+1 depend on the tokens sampled in step N, so they cannot start
before `update_from_output`; they are needed only at sampling, after the forward pass.
`StepMasks.start` hands the matchers to one worker thread right after `schedule()` (the
llguidance calls drop the GIL, as do the model's C kernels and torch ops) and the model
runner waits on `GrammarBitmask.wait()` just before it samples.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from fleetserve.core.request import Request
from fleetserve.core.scheduler_output import SchedulerOutput
from fleetserve.core.structured import GrammarBitmask, GrammarMatcher, bitmask_bias


class StepMasks:
    def __init__(self, mask_vocab_size: int, overlap: bool = True) -> None:
        self.num_words = (mask_vocab_size + 31) // 32
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask") if overlap else None
        # Totals for the stats: steps with masks, rows filled, seconds spent filling.
        self.num_steps = 0
        self.num_rows = 0
        self.fill_seconds = 0.0

    def start(
        self, sched_out: SchedulerOutput, requests: Mapping[str, Request]
    ) -> GrammarBitmask | None:
        """The masks of the constrained requests that sample in this step (None: none)."""
        jobs: list[tuple[GrammarMatcher, int, list[int]]] = []
        rows: dict[str, int] = {}
        num_rows = 0
        spec = sched_out.scheduled_spec_decode_tokens
        for req_id, num_new in sched_out.num_scheduled_tokens.items():
            req = requests[req_id]
            if req.grammar is None:
                continue
            drafts = spec.get(req_id, [])
            if req.num_computed_tokens + num_new < req.num_tokens + len(drafts):
                continue  # a prompt chunk that does not reach the end: nothing sampled
            rows[req_id] = num_rows
            jobs.append((req.grammar, num_rows, drafts))
            num_rows += 1 + len(drafts)
        if not jobs:
            return None
        bits = np.full((num_rows, self.num_words), -1, dtype=np.int32)
        mask = GrammarBitmask(rows, bits, _done=threading.Event())
        if self._pool is None:
            self._fill(mask, jobs)
        else:
            self._pool.submit(self._fill, mask, jobs)
        return mask

    def _fill(
        self, mask: GrammarBitmask, jobs: list[tuple[GrammarMatcher, int, list[int]]]
    ) -> None:
        t0 = time.perf_counter()
        try:
            for matcher, row, drafts in jobs:
                matcher.fill_bitmask(mask.bits, row, drafts)
            mask.bias = bitmask_bias(mask.bits)
        except BaseException as e:  # surfaced by wait() in the runner
            mask.error = f"{type(e).__name__}: {e}"
        finally:
            mask.fill_seconds = time.perf_counter() - t0
            self.num_steps += 1
            self.num_rows += len(mask.bits)
            self.fill_seconds += mask.fill_seconds
            assert mask._done is not None
            mask._done.set()

    def stats(self) -> dict[str, float]:
        return {
            "structured_mask_steps": self.num_steps,
            "structured_mask_rows": self.num_rows,
            "structured_mask_seconds": self.fill_seconds,
        }

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
