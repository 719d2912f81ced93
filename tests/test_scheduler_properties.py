"""Property tests: random add / step / abort sequences over a small cache and budget.

After every operation the block manager's invariants hold, the budget and max_num_seqs
are respected, every running request holds blocks for its computed tokens, waiting
requests hold none, the fake runner's mirrored state (built only from the scheduler's
diffs) matches the scheduler, and every step with work pending schedules something.
When everything has finished, every block is free.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st

from fleetserve.core.request import Request, RequestStatus
from fleetserve.core.sampling_params import SamplingParams
from test_scheduler import BS, Harness

EOS = 7  # fake_token() returns it now and then, so some requests stop early
PREFIXES = [list(range(100, 116)), list(range(200, 216))]


@dataclass(frozen=True)
class Add:
    prefix: int  # index into PREFIXES, or -1 for none
    prefix_len: int
    suffix: tuple[int, ...]
    max_tokens: int
    n: int
    priority: int


@dataclass(frozen=True)
class Step:
    abort_mid_step: int | None = None  # index among live requests to abort mid-step


@dataclass(frozen=True)
class Abort:
    index: int


adds = st.builds(
    Add,
    prefix=st.sampled_from([0, 0, 1, -1]),
    prefix_len=st.integers(0, 16),
    suffix=st.lists(st.integers(0, 99), min_size=0, max_size=6).map(tuple),
    max_tokens=st.integers(1, 12),
    n=st.sampled_from([1, 1, 1, 2, 3]),
    priority=st.integers(0, 2),
)
steps = st.builds(Step, abort_mid_step=st.none() | st.integers(0, 20))
aborts = st.builds(Abort, index=st.integers(0, 20))
ops = st.lists(st.one_of(adds, adds, steps, steps, steps, aborts), min_size=1, max_size=40)


class Checker:
    def __init__(self, h: Harness) -> None:
        self.h = h
        self.count = 0
        self.live: list[str] = []

    def invariants(self) -> None:
        h = self.h
        bm, sched = h.bm, h.sched
        bm.check_invariants()
        for req in sched.running:
            assert req.status == RequestStatus.RUNNING
            assert len(bm.block_ids(req.req_id)) * BS >= req.num_computed_tokens
            assert req.num_computed_tokens <= req.num_tokens
        for req in sched.waiting:
            assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert bm.block_ids(req.req_id) == []
            assert req.num_computed_tokens == 0
        live = {r.req_id for r in sched.running + sched.waiting}
        assert live == set(sched.requests)
        assert set(bm.req_to_blocks) <= live
        held = {b for blocks in bm.req_to_blocks.values() for b in blocks}
        assert bm.num_free_blocks == bm.num_blocks - len(held)
        self.live = [r for r in self.live if r in live]

    def add(self, op: Add) -> None:
        prompt = (PREFIXES[op.prefix][: op.prefix_len] if op.prefix >= 0 else []) + list(op.suffix)
        if not prompt:
            prompt = [1]
        group = f"g{self.count}" if op.n > 1 else None
        sched = self.h.sched
        before = (list(sched.requests), list(sched.waiting))
        for i in range(op.n):
            req_id = f"r{self.count}#{i}"
            req = Request(
                req_id,
                prompt,
                SamplingParams(max_tokens=op.max_tokens),
                eos_token_ids=(EOS,),
                priority=op.priority,
                arrival_time=float(self.count),
                group_id=group,
            )
            try:
                sched.add_request(req)
            except ValueError:
                # Too big for this cache or max_model_len: rejected, nothing changed.
                assert i == 0
                assert (list(sched.requests), list(sched.waiting)) == before
                return
            self.h.tokens[req_id] = []
            self.live.append(req_id)
        self.count += 1

    def abort(self, index: int) -> None:
        if self.live:
            req_id = self.live[index % len(self.live)]
            self.h.sched.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)

    def step(self, abort_mid_step: int | None = None) -> None:
        h = self.h
        pending = h.sched.has_unfinished_requests()
        so = h.schedule()
        if pending:
            assert so.total_num_scheduled_tokens > 0, "work pending but nothing scheduled"
        result = h.runner.execute(so)
        if abort_mid_step is not None:
            self.invariants()
            self.abort(abort_mid_step)
        self.invariants()
        h.update(so, result)
        self.invariants()


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
@given(
    ops=ops,
    num_blocks=st.integers(3, 10),
    budget=st.integers(1, 12),
    max_num_seqs=st.integers(1, 6),
    prefix_caching=st.booleans(),
    policy=st.sampled_from(["fcfs", "priority"]),
)
def test_random_add_step_abort_keeps_invariants_and_leaks_nothing(
    ops: list[Add | Step | Abort],
    num_blocks: int,
    budget: int,
    max_num_seqs: int,
    prefix_caching: bool,
    policy: str,
) -> None:
    h = Harness(
        num_blocks=num_blocks,
        budget=budget,
        max_num_seqs=max_num_seqs,
        max_model_len=32,
        prefix_caching=prefix_caching,
        policy=policy,
    )
    c = Checker(h)
    for op in ops:
        if isinstance(op, Add):
            c.add(op)
        elif isinstance(op, Abort):
            c.abort(op.index)
        else:
            c.step(op.abort_mid_step)
        c.invariants()
    # Drain: everything finishes in bounded time and gives every block back.
    for _ in range(2000):
        if not h.sched.has_unfinished_requests():
            break
        c.step()
    # Steer the search toward the interesting schedules.
    target(float(h.sched.num_preemptions), label="preemptions")
    target(float(h.bm.num_hit_tokens), label="prefix hits")
    assert not h.sched.has_unfinished_requests()
    assert h.all_free()
    assert all(b.ref_cnt == 0 for b in h.bm.blocks)
    # A request stops at its first EOS and only there; otherwise it runs to its length.
    for req_id, reason in h.finish_reasons.items():
        toks = h.tokens[req_id]
        assert 1 <= len(toks) <= 12
        assert EOS not in toks[:-1]
        assert reason == ("stop" if toks[-1] == EOS else "length")


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    prompt_lens=st.lists(st.integers(1, 20), min_size=2, max_size=6),
    num_blocks=st.integers(6, 10),
    budget=st.integers(1, 16),
    prefix_caching=st.booleans(),
)
def test_tokens_do_not_depend_on_cache_size_budget_or_preemption(
    prompt_lens: list[int], num_blocks: int, budget: int, prefix_caching: bool
) -> None:
    """The fake runner's tokens are a function of the request's own tokens, so any
    scheduling (chunking, preemption, prefix hits) must give the same tokens as a roomy,
    unconstrained run."""

    def run(h: Harness) -> dict[str, list[int]]:
        for i, n in enumerate(prompt_lens):
            h.add(f"r{i}", [(i * 7 + j) % 5 + 100 for j in range(n)], max_tokens=4)
        c = Checker(h)
        for _ in range(1000):
            if not h.sched.has_unfinished_requests():
                break
            c.step()
        assert h.all_free()
        return h.tokens

    ref = run(Harness(num_blocks=64, budget=64, prefix_caching=False))
    h = Harness(num_blocks=num_blocks, budget=budget, prefix_caching=prefix_caching)
    assert run(h) == ref
    target(float(h.sched.num_preemptions), label="preemptions")
