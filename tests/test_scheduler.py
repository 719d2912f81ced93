"""Scheduler: token budget, chunked prefill, preemption, priority, abort, n>1 siblings.

A fake model runner mirrors the scheduler's diffs the way the real ModelRunner does,
checks them against the scheduler's own state, and "samples" a token that is a pure
function of the request's tokens so far, so a recomputed request yields the same tokens.
"""

from __future__ import annotations

import zlib

import pytest

from fleetserve.core.block_manager import BlockManager
from fleetserve.core.config import SchedulerConfig
from fleetserve.core.request import Request, RequestStatus
from fleetserve.core.sampling_params import SamplingParams
from fleetserve.core.scheduler import Scheduler
from fleetserve.core.scheduler_output import (
    EngineCoreOutput,
    ModelRunnerOutput,
    SchedulerOutput,
)

BS = 4


def fake_token(token_ids: list[int]) -> int:
    return (sum(token_ids) * 31 + len(token_ids)) % 97 + 3


class FakeRunner:
    """Keeps its own copy of each request (token ids, block ids, computed count), built
    only from SchedulerOutput diffs, and asserts it matches the scheduler."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.states: dict[str, tuple[list[int], list[int], list[int]]] = {}

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in so.finished_req_ids:
            self.states.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.states, f"{new.req_id} sent as new twice"
            self.states[new.req_id] = (
                list(new.token_ids),
                list(new.block_ids),
                [new.num_computed_tokens],
            )
        for cached in so.scheduled_cached_reqs:
            tokens, blocks, computed = self.states[cached.req_id]
            tokens.extend(cached.new_token_ids)
            blocks.extend(cached.new_block_ids)
            computed[0] = cached.num_computed_tokens
        bm = self.scheduler.block_manager
        sampled = []
        for req_id, n in so.num_scheduled_tokens.items():
            tokens, blocks, (computed,) = self.states[req_id]
            req = self.scheduler.requests[req_id]
            assert tokens == req.all_token_ids
            assert blocks == bm.block_ids(req_id)
            assert computed == req.num_computed_tokens
            assert n >= 1 and computed + n <= len(tokens)
            assert len(blocks) * bm.block_size >= computed + n
            sampled.append([fake_token(tokens)] if computed + n == len(tokens) else [])
        return ModelRunnerOutput(req_ids=list(so.num_scheduled_tokens), sampled_token_ids=sampled)


class Harness:
    def __init__(
        self,
        num_blocks: int = 64,
        budget: int = 64,
        max_num_seqs: int = 16,
        max_model_len: int = 256,
        prefix_caching: bool = True,
        policy: str = "fcfs",
        chunked_prefill: bool = True,
    ) -> None:
        self.config = SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            chunked_prefill=chunked_prefill,
            policy=policy,
        )
        self.bm = BlockManager(num_blocks, BS, prefix_caching)
        self.sched = Scheduler(self.config, self.bm)
        self.runner = FakeRunner(self.sched)
        self.tokens: dict[str, list[int]] = {}
        self.finish_reasons: dict[str, str] = {}
        self.history: list[dict[str, int]] = []
        self._arrival = 0.0

    def add(
        self, req_id: str, prompt: list[int] | int, max_tokens: int = 4, **kw: object
    ) -> Request:
        if isinstance(prompt, int):
            # Same id, same prompt; different ids start with different tokens, so no two
            # requests share a cached block by chance. (Python's str hash is salted per
            # process, which once let such a share through in ~4% of runs.)
            base = 100 + 50 * (zlib.crc32(req_id.encode()) % 1000)
            prompt = [base + i % 50 for i in range(prompt)]
        self._arrival += 1.0
        kw.setdefault("arrival_time", self._arrival)
        req = Request(req_id, prompt, SamplingParams(max_tokens=max_tokens), **kw)  # type: ignore[arg-type]
        self.sched.add_request(req)
        self.tokens[req_id] = []
        return req

    def schedule(self) -> SchedulerOutput:
        so = self.sched.schedule()
        self.check(so)
        self.history.append(dict(so.num_scheduled_tokens))
        return so

    def update(self, so: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outs = self.sched.update_from_output(so, result)
        for o in outs:
            self.tokens[o.req_id] += o.new_token_ids
            if o.finished:
                self.finish_reasons[o.req_id] = o.finish_reason  # type: ignore[assignment]
        self.bm.check_invariants()
        return outs

    def step(self) -> dict[str, int]:
        so = self.schedule()
        self.update(so, self.runner.execute(so))
        return dict(so.num_scheduled_tokens)

    def run(self, max_steps: int = 200) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                return
            self.step()
        raise AssertionError("requests did not finish")

    def check(self, so: SchedulerOutput) -> None:
        self.bm.check_invariants()
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        assert so.total_num_scheduled_tokens <= self.config.max_num_batched_tokens
        assert len(so.num_scheduled_tokens) <= self.config.max_num_seqs
        assert len(self.sched.running) <= self.config.max_num_seqs
        for req in self.sched.running:
            assert len(self.bm.block_ids(req.req_id)) * BS >= req.num_computed_tokens

    def all_free(self) -> bool:
        return self.bm.num_free_blocks == self.bm.num_blocks and not self.bm.req_to_blocks


def test_token_budget_is_respected_and_running_requests_come_first() -> None:
    h = Harness(budget=8)
    h.add("a", 20)
    assert h.step() == {"a": 8}
    h.add("b", 6)
    # a is running mid-prefill and takes the whole budget; b waits.
    assert h.step() == {"a": 8}
    assert h.sched.waiting[0].req_id == "b"
    # a's last 4 prompt tokens, then b gets what is left.
    assert h.step() == {"a": 4, "b": 4}
    assert h.step() == {"a": 1, "b": 2}
    assert h.step() == {"a": 1, "b": 1}
    assert h.tokens["a"] and h.tokens["b"]
    h.run()
    assert all(sum(s.values()) <= 8 for s in h.history)
    assert h.all_free()


def test_chunked_prefill_splits_a_long_prompt_and_mixes_it_with_decodes() -> None:
    h = Harness(budget=8)
    h.add("a", 5, max_tokens=10)
    assert h.step() == {"a": 5}
    h.add("long", 20, max_tokens=2)
    # a decodes one token a step; the long prompt gets the remaining 7 tokens.
    chunks = [h.step() for _ in range(3)]
    assert chunks == [{"a": 1, "long": 7}, {"a": 1, "long": 7}, {"a": 1, "long": 6}]
    long_req = h.sched.requests["long"]
    # No token is sampled until the last chunk of the prompt is in.
    assert h.tokens["long"] == [fake_token(long_req.prompt_token_ids)]
    assert len(h.tokens["a"]) == 4
    h.run()
    assert len(h.tokens["long"]) == 2 and len(h.tokens["a"]) == 10


def test_chunked_prefill_off_waits_for_a_budget_that_holds_the_whole_prompt() -> None:
    h = Harness(budget=16, max_model_len=16, chunked_prefill=False)
    h.add("a", 10)
    h.add("b", 10)
    assert h.step() == {"a": 10}  # b's 10 tokens do not fit in the 6 left
    assert h.step() == {"a": 1, "b": 10}
    h.run()
    assert h.all_free()


def test_max_num_seqs_is_respected() -> None:
    h = Harness(max_num_seqs=2)
    for r in "abc":
        h.add(r, 5, max_tokens=3)
    assert set(h.step()) == {"a", "b"}
    assert [r.req_id for r in h.sched.waiting] == ["c"]
    assert set(h.step()) == {"a", "b"}
    assert set(h.step()) == {"a", "b"}  # a and b finish here
    assert h.finish_reasons == {"a": "length", "b": "length"}
    assert h.step() == {"c": 5}
    h.run()
    assert all(len(s) <= 2 for s in h.history)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_takes_the_newest_request_which_resumes_with_the_same_tokens(
    prefix_caching: bool,
) -> None:
    # Reference: the same two requests in a cache large enough for both.
    ref = Harness(num_blocks=16, prefix_caching=prefix_caching)
    ref.add("a", 7)
    ref.add("b", 7)
    ref.run()
    assert ref.sched.num_preemptions == 0

    h = Harness(num_blocks=4, prefix_caching=prefix_caching)
    a = h.add("a", 7)  # 7 + 4 tokens: 3 blocks each, but only 4 blocks in all
    b = h.add("b", 7)
    assert h.step() == {"a": 7, "b": 7}
    assert h.bm.block_ids("a") == [0, 1] and h.bm.block_ids("b") == [2, 3]
    assert h.step() == {"a": 1, "b": 1}  # 9 tokens each, 8 computed
    # a's 9th token needs a third block: b, the newest, is preempted.
    so = h.schedule()
    assert so.num_scheduled_tokens == {"a": 1}
    assert "b" in so.finished_req_ids  # the runner must drop b's stale state
    assert b.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert h.sched.num_preemptions == 1
    assert h.sched.waiting == [b] and h.sched.running == [a]
    assert h.bm.block_ids("b") == []
    # b's tail block is the one taken; its head block stays cached when caching is on.
    assert h.bm.block_ids("a") == [0, 1, 3] if prefix_caching else [0, 1, 2]
    h.update(so, h.runner.execute(so))
    assert len(b.output_token_ids) == 2  # kept: recomputed, not regenerated

    so = h.schedule()  # a finishes; b cannot come back in the same step's blocks
    assert so.num_scheduled_tokens == {"a": 1}
    h.update(so, h.runner.execute(so))
    assert h.finish_reasons == {"a": "length"}

    so = h.schedule()
    assert [n.req_id for n in so.scheduled_new_reqs] == ["b"]
    resumed = so.scheduled_new_reqs[0]
    assert resumed.token_ids == b.all_token_ids and len(resumed.token_ids) == 9
    assert resumed.num_output_tokens == 2
    # With caching on, b's first block survived eviction and is hit.
    assert resumed.num_computed_tokens == (4 if prefix_caching else 0)
    assert so.num_scheduled_tokens == {"b": 9 - resumed.num_computed_tokens}
    h.update(so, h.runner.execute(so))
    h.run()
    assert h.tokens == ref.tokens
    assert h.finish_reasons == {"a": "length", "b": "length"}
    assert h.all_free()


def test_priority_policy_schedules_lower_values_first() -> None:
    h = Harness(max_num_seqs=1, policy="priority")
    h.add("c", 5, max_tokens=1, priority=3)
    h.add("a", 5, max_tokens=1, priority=1)
    h.add("b", 5, max_tokens=1, priority=2)
    h.add("a2", 5, max_tokens=1, priority=1)  # same priority: arrival order
    order = [next(iter(h.step())) for _ in range(4)]
    assert order == ["a", "a2", "b", "c"]


@pytest.mark.parametrize(
    ("policy", "victim", "survivor"), [("priority", "a", "b"), ("fcfs", "b", "a")]
)
def test_preemption_victim_is_the_least_important_request(
    policy: str, victim: str, survivor: str
) -> None:
    h = Harness(num_blocks=4, policy=policy)
    # a is older but less important. a's 6th token fits in its 2 blocks; b's 9th does not.
    h.add("a", 5, max_tokens=4, priority=5)
    h.add("b", 8, max_tokens=4, priority=0)
    assert h.step() == {"a": 5, "b": 8}
    so = h.schedule()
    # Under "priority" a was scheduled first, then given back its token when preempted.
    assert so.num_scheduled_tokens == {survivor: 1}
    assert so.total_num_scheduled_tokens == 1
    assert h.sched.requests[victim].status == RequestStatus.PREEMPTED
    assert h.sched.requests[victim].num_computed_tokens == 0
    assert [r.req_id for r in h.sched.running] == [survivor]
    h.update(so, h.runner.execute(so))
    h.run()
    assert set(h.finish_reasons) == {"a", "b"}
    assert h.all_free()


@pytest.mark.parametrize("when", ["waiting", "running", "mid_prefill", "mid_step"])
def test_abort_frees_every_block(when: str) -> None:
    h = Harness(num_blocks=16, budget=8)
    h.add("other", 3, max_tokens=6)
    victim = h.add("x", 12, max_tokens=6)
    if when == "waiting":
        h.sched.finish_requests(["x"], RequestStatus.FINISHED_ABORTED)
        assert h.bm.block_ids("x") == []
    elif when == "mid_prefill":
        assert h.step() == {"other": 3, "x": 5}
        assert 0 < victim.num_computed_tokens < victim.num_prompt_tokens
        h.sched.finish_requests(["x"], RequestStatus.FINISHED_ABORTED)
    elif when == "running":
        h.step()
        h.step()
        assert victim.num_output_tokens == 1
        h.sched.finish_requests(["x"], RequestStatus.FINISHED_ABORTED)
    else:
        h.step()
        so = h.schedule()
        result = h.runner.execute(so)
        h.sched.finish_requests(["x"], RequestStatus.FINISHED_ABORTED)
        outs = h.update(so, result)  # x's sampled token is dropped
        assert [o.req_id for o in outs] == ["other"]
    h.bm.check_invariants()
    assert victim.status == RequestStatus.FINISHED_ABORTED
    assert "x" not in h.sched.requests and victim not in h.sched.running + h.sched.waiting
    assert h.bm.block_ids("x") == []
    held = len(h.bm.block_ids("other"))
    assert h.bm.num_free_blocks == h.bm.num_blocks - held
    # Aborting again, or an unknown id, is a no-op.
    assert h.sched.finish_requests(["x", "nope"], RequestStatus.FINISHED_ABORTED) == []
    so = h.schedule()
    if when != "waiting":
        assert "x" in so.finished_req_ids
    h.update(so, h.runner.execute(so))
    h.run()
    assert len(h.tokens["other"]) == 6
    assert h.all_free()


def test_requests_that_can_never_fit_are_rejected_at_add_time() -> None:
    h = Harness(num_blocks=4, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        h.add("long", 64)
    with pytest.raises(ValueError, match="KV blocks"):
        h.add("big", 10, max_tokens=7)  # 17 tokens need 5 blocks of 4
    h.add("ok", 10, max_tokens=6)  # 16 tokens: exactly 4 blocks
    with pytest.raises(ValueError, match="already in use"):
        h.add("ok", 3)
    assert list(h.sched.requests) == ["ok"]
    assert [r.req_id for r in h.sched.waiting] == ["ok"]
    h.run()
    assert h.finish_reasons == {"ok": "length"}


def test_n_siblings_share_prompt_blocks() -> None:
    h = Harness(num_blocks=16)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    sibs = [h.add(f"r#{i}", prompt, max_tokens=3, group_id="r") for i in range(3)]
    # The first sibling prefills alone; the others wait for its blocks to be cached.
    assert h.step() == {"r#0": 10}
    assert h.bm.block_ids("r#0") == [0, 1, 2]
    assert h.step() == {"r#0": 1, "r#1": 2, "r#2": 2}
    assert h.bm.block_ids("r#1") == [0, 1, 3]
    assert h.bm.block_ids("r#2") == [0, 1, 4]
    assert [h.bm.blocks[b].ref_cnt for b in range(5)] == [3, 3, 1, 1, 1]
    assert [s.num_cached_tokens for s in sibs] == [0, 8, 8]
    h.run()
    # The fake runner is deterministic, so the siblings' tokens agree.
    assert h.tokens["r#0"] == h.tokens["r#1"] == h.tokens["r#2"]
    assert h.all_free()


def test_a_request_without_max_tokens_stops_at_max_model_len() -> None:
    h = Harness(max_model_len=12)
    req = Request("a", list(range(5)), SamplingParams(max_tokens=None))
    h.sched.add_request(req)
    h.tokens["a"] = []
    h.run()
    assert len(h.tokens["a"]) == 7 and req.num_tokens == 12
    assert h.finish_reasons == {"a": "length"}
    assert h.all_free()


def test_stopping_a_running_request_frees_its_blocks() -> None:
    """The engine stops requests on stop strings from outside the core."""
    h = Harness()
    a = h.add("a", 9, max_tokens=8)
    h.add("b", 9, max_tokens=3)
    h.step()
    h.step()
    assert h.sched.finish_requests(["a"], RequestStatus.FINISHED_STOPPED) == [a]
    assert a.status.finish_reason == "stop"
    assert h.bm.block_ids("a") == []
    h.run()
    assert len(h.tokens["a"]) == 2 and len(h.tokens["b"]) == 3
    assert h.all_free()


def test_prefix_hit_rate_counts_each_admitted_request_once() -> None:
    # c waits three steps behind a and b; its lookups while waiting must not count.
    h = Harness(max_num_seqs=2)
    shared = [7] * 8  # two full blocks
    h.add("a", shared + [1], max_tokens=3)
    h.run()
    h.add("b", 5, max_tokens=3)
    h.add("x", 5, max_tokens=3)
    h.add("c", shared + [2], max_tokens=3)
    h.run()
    # Queried: a (9) + b (5) + x (5) + c (9) tokens; hit: c's two cached blocks.
    assert h.bm.num_queried_tokens == 9 + 5 + 5 + 9
    assert h.bm.num_hit_tokens == 8


def test_priority_waiting_request_takes_a_full_batch_seat() -> None:
    """Under "priority" a more important arrival preempts the least important running
    request when the batch is full; an equally important one waits (no churn)."""
    h = Harness(max_num_seqs=2, policy="priority")
    h.add("low1", 5, max_tokens=20, priority=10)
    h.add("low2", 5, max_tokens=20, priority=10)
    assert h.step() == {"low1": 5, "low2": 5}
    h.add("same", 5, max_tokens=2, priority=10)
    assert h.step() == {"low1": 1, "low2": 1}
    h.add("high", 5, max_tokens=2, priority=0)
    # low2 is the newest of the least important: it gives its seat to high.
    assert h.step() == {"low1": 1, "high": 5}
    assert h.sched.requests["low2"].status == RequestStatus.PREEMPTED
    assert [r.req_id for r in h.sched.running] == ["low1", "high"]
    h.run()
    assert h.finish_reasons == {r: "length" for r in ("low1", "low2", "same", "high")}
    assert h.all_free()


def test_priority_arrival_goes_ahead_of_a_deep_queue_of_less_important_work() -> None:
    """An oversubscribed batch class keeps a queue of its requests waiting in the engine:
    an important arrival still takes a seat on the next step, ahead of all of them, and a
    slot freed by a batch request goes to the oldest waiting one, the preempted first."""
    h = Harness(max_num_seqs=2, policy="priority")
    for i in range(6):
        h.add(f"low{i}", 5, max_tokens=3 if i == 0 else 20, priority=10)
    assert h.step() == {"low0": 5, "low1": 5}
    h.add("high", 5, max_tokens=2, priority=0)
    assert h.step() == {"low0": 1, "high": 5}  # low1, the newest running, gives its seat
    assert h.sched.requests["low1"].status == RequestStatus.PREEMPTED
    # low0 ends this step; its slot goes straight to the oldest waiting request (low1),
    # without a round trip: the engine's own queue refills it on the next step.
    assert h.step() == {"low0": 1, "high": 1}
    assert h.finish_reasons == {"low0": "length", "high": "length"}
    assert set(h.step()) == {"low1", "low2"}  # low1 resumes on its cached prefix block
    h.run()
    assert set(h.finish_reasons) == {f"low{i}" for i in range(6)} | {"high"}
    assert h.all_free()


def test_fcfs_waiting_request_never_preempts_for_a_seat() -> None:
    h = Harness(max_num_seqs=1, policy="fcfs")
    h.add("a", 5, max_tokens=3, priority=10)
    h.step()
    h.add("b", 5, max_tokens=1, priority=0)
    assert h.step() == {"a": 1}


def test_priority_waiting_request_takes_a_victims_blocks() -> None:
    """Out of blocks: the important arrival frees the least important running request's."""
    h = Harness(num_blocks=4, max_num_seqs=8, policy="priority")
    h.add("low", 12, max_tokens=4, priority=10)  # 3 blocks, then a 4th for its 13th token
    assert h.step() == {"low": 12}
    h.add("high", 6, max_tokens=2, priority=0)  # needs 2 blocks; 1 is free
    assert h.step() == {"high": 6}
    assert h.sched.requests["low"].status == RequestStatus.PREEMPTED
    h.run()
    assert set(h.finish_reasons) == {"low", "high"}
    assert h.all_free()


def test_priority_waiting_request_takes_a_less_important_ones_budget() -> None:
    """The budget is spent: the important arrival takes the least important scheduled
    request's tokens for this step; that one keeps its blocks and goes on next step."""
    h = Harness(budget=8, max_num_seqs=4, policy="priority", num_blocks=32)
    h.add("low", 30, max_tokens=2, priority=10)
    assert h.step() == {"low": 8}  # a chunk of its prefill fills the budget
    h.add("high", 5, max_tokens=2, priority=0)
    assert h.step() == {"high": 5, "low": 3}
    assert h.sched.requests["low"].status == RequestStatus.RUNNING  # not preempted
    assert h.sched.requests["low"].num_computed_tokens == 11
    h.run()
    assert set(h.finish_reasons) == {"low", "high"}
    assert h.all_free()


def test_fcfs_waiting_request_waits_for_budget() -> None:
    h = Harness(budget=8, max_num_seqs=4, policy="fcfs", num_blocks=32)
    h.add("low", 30, max_tokens=2, priority=10)
    h.step()
    h.add("high", 5, max_tokens=2, priority=0)
    assert h.step() == {"low": 8}


@pytest.mark.parametrize(
    ("num_lookahead", "num_burst_lookahead", "reserves"),
    [(0, 0, False), (3, 0, True), (0, 5, True), (2, 4, True)],
)
def test_config_reserves_lookahead_when_drafts_or_bursts_want_slots(
    num_lookahead: int, num_burst_lookahead: int, reserves: bool
) -> None:
    config = SchedulerConfig(
        num_lookahead_tokens=num_lookahead, num_burst_lookahead_tokens=num_burst_lookahead
    )
    assert config.reserves_lookahead is reserves
