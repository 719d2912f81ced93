"""Deltas end to end, without engine processes: merging what a slow reader missed
(outputs.merge_delta, the DeltaQueue), folding deltas into the whole answer (OutputFold),
the OutputProcessor's deltas (new text only, stop strings held back, each choice ends
once, nothing cumulative), and the one RequestState a FleetStream keeps across a
migration."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest

from fleetserve.core.sampling_params import SamplingParams
from fleetserve.core.scheduler_output import EngineCoreOutput
from fleetserve.engine.async_engine import EngineDeadError, ReplicaGoneError
from fleetserve.engine.delta_stream import DeltaQueue
from fleetserve.engine.output_processor import OutputProcessor
from fleetserve.models.loader import resolve_model
from fleetserve.outputs import (
    CompletionOutput,
    OutputFold,
    RequestOutput,
    RequestOutputKind,
    fold,
    merge_delta,
)
from fleetserve.serve.contracts import ReplicaStreamLike
from fleetserve.serve.request_state import FleetStream, RequestState
from fleetserve.tokenizer import Tokenizer

PROMPT = [5, 6, 7]


def delta(
    tokens: dict[int, list[int]],
    finish: dict[int, str] | None = None,
    prompt_logprobs: Any = None,
) -> RequestOutput:
    """A delta of choices {index: new tokens}; text is the tokens as "<t>", logprobs -t."""
    finish = finish or {}
    outs = [
        CompletionOutput(
            i,
            "".join(f"<{t}>" for t in ids),
            list(ids),
            finish.get(i),
            None,
            [{t: -float(t)} for t in ids],
            -1.0,
        )  # fmt: skip
        for i, ids in tokens.items()
    ]
    done = bool(finish) and all(i in finish for i in tokens) and len(finish) == 2
    return RequestOutput("r", None, PROMPT, outs, done, prompt_logprobs)


def test_merging_deltas_equals_folding_them() -> None:
    deltas = [
        delta({0: [1], 1: [10]}, prompt_logprobs=[None, {6: -1.0}, {7: -2.0}]),
        delta({0: [2, 3], 1: [11]}, finish={1: "stop"}),
        delta({0: [4]}),
        delta({0: [5]}, finish={0: "length", 1: "stop"}),
    ]
    merged = copy.deepcopy(deltas[0])
    for d in deltas[1:]:
        merge_delta(merged, d)
    assert merged.finished and merged.prompt_logprobs == [None, {6: -1.0}, {7: -2.0}]
    whole = fold(deltas)
    assert whole.kind is RequestOutputKind.CUMULATIVE
    by_index = {c.index: c for c in merged.outputs}
    for c in whole.outputs:
        m = by_index[c.index]
        assert (m.token_ids, m.text, m.logprobs) == (c.token_ids, c.text, c.logprobs)
        assert m.finish_reason == c.finish_reason
    assert whole.outputs[0].token_ids == [1, 2, 3, 4, 5]
    assert whole.outputs[1].token_ids == [10, 11] and whole.outputs[1].finish_reason == "stop"
    # merge_delta never changes the later delta it reads
    assert deltas[1].outputs[0].token_ids == [2, 3]


def test_a_fold_hands_out_copies_and_can_start_from_a_resume() -> None:
    acc = OutputFold("r", 2)
    acc.add(delta({0: [1], 1: [10]}))
    first = acc.output()
    acc.add(delta({0: [2]}))
    assert first.outputs[0].token_ids == [1]  # not mutated by later deltas
    assert acc.tokens_so_far() == [1, 2, 10] and acc.num_generated == 3
    assert acc.max_choice_tokens() == 2
    resumed = OutputFold("r", 2, start=acc.output())
    resumed.add(delta({0: [3]}, finish={0: "length", 1: "length"}))
    assert resumed.output().outputs[0].token_ids == [1, 2, 3]
    assert resumed.output().outputs[0].text == "<1><2><3>" and resumed.finished


def test_a_slow_reader_gets_one_merged_delta_of_all_it_missed() -> None:
    async def main() -> None:
        q = DeltaQueue()
        q.put(delta({0: [1]}))
        q.put(delta({0: [2], 1: [10]}))
        q.put(delta({0: [3]}))
        got = await q.get()  # one delta: everything, nothing skipped
        assert [(c.index, c.token_ids) for c in got.outputs] == [(0, [1, 2, 3]), (1, [10])]
        assert got.outputs[0].text == "<1><2><3>"
        assert got.outputs[0].logprobs == [{1: -1.0}, {2: -2.0}, {3: -3.0}]
        # An error ends the stream after what came before it; later deltas are dropped.
        q.put(delta({0: [4]}))
        q.fail(ReplicaGoneError("gone"))
        q.put(delta({0: [5]}))
        q.fail(EngineDeadError("second error"))  # the first error wins
        assert (await q.get()).outputs[0].token_ids == [4]
        with pytest.raises(ReplicaGoneError, match="gone"):
            await q.get()
        # A reader waiting for the next delta wakes when it comes.
        q2 = DeltaQueue()
        waiter = asyncio.ensure_future(q2.get())
        await asyncio.sleep(0)
        q2.put(delta({0: [9]}))
        assert (await waiter).outputs[0].token_ids == [9]

    asyncio.run(main())


@pytest.fixture(scope="module")
def tok(tiny_llama: str) -> Tokenizer:
    return Tokenizer.from_source(resolve_model(tiny_llama))


def run_processor(
    tok: Tokenizer, ids: list[int], params: SamplingParams, per_step: int = 1
) -> list[RequestOutput]:
    proc = OutputProcessor(tok)
    (cid,) = proc.add_request("r", None, PROMPT, params)
    deltas = []
    for i in range(0, len(ids), per_step):
        last = i + per_step >= len(ids)
        eo = EngineCoreOutput(cid, ids[i : i + per_step], finish_reason="length" if last else None)
        outs, to_stop = proc.process([eo])
        deltas.extend(outs)
        if to_stop:
            break
    assert not proc.has_unfinished()
    return deltas


def test_processor_deltas_hold_only_what_is_new(tok: Tokenizer) -> None:
    text = "The cat saw 東京 and a café 🙂, then the cat sat down."
    ids = tok.encode(text)
    deltas = run_processor(tok, ids, SamplingParams(max_tokens=len(ids)))
    # Each step's delta holds that step's one token (not everything so far).
    assert all(len(d.outputs[0].token_ids) == 1 for d in deltas)
    assert "".join(d.outputs[0].text for d in deltas) == tok.decode(ids)
    ends = [d.outputs[0].finish_reason for d in deltas]
    assert ends[:-1] == [None] * (len(ends) - 1) and ends[-1] == "length"
    assert deltas[-1].finished and "e2e_latency" in deltas[-1].metrics


@pytest.mark.parametrize("per_step", [1, 3])
def test_processor_holds_a_stop_string_prefix_back_and_cuts_at_it(
    tok: Tokenizer, per_step: int
) -> None:
    ids = tok.encode("one two three four five six")
    params = SamplingParams(max_tokens=len(ids), stop=["four"])
    deltas = run_processor(tok, ids, params, per_step)
    sent = "".join(d.outputs[0].text for d in deltas if d.outputs)
    assert sent == "one two three "
    assert deltas[-1].outputs[0].finish_reason == "stop"
    assert deltas[-1].outputs[0].stop_reason == "four"
    # The text never shrinks: no delta sent "f", "fo" or "fou" before the stop was seen.
    assert not any("f" in d.outputs[0].text for d in deltas if d.outputs)


def test_processor_deltas_name_only_the_choices_that_changed(tok: Tokenizer) -> None:
    proc = OutputProcessor(tok)
    params = SamplingParams(n=2, max_tokens=4, logprobs=0)
    c0, c1 = proc.add_request("r", None, PROMPT, params)
    (d,), _ = proc.process([EngineCoreOutput(c0, [40], [{40: -0.5}]),
                            EngineCoreOutput(c1, [41], [{41: -0.25}], finish_reason="stop")])  # fmt: skip
    assert [(c.index, c.finish_reason) for c in d.outputs] == [(0, None), (1, "stop")]
    (d,), _ = proc.process([EngineCoreOutput(c0, [42], [{42: -1.0}])])
    assert [c.index for c in d.outputs] == [0]  # the finished choice is not repeated
    assert d.outputs[0].logprobs == [{42: -1.0}] and d.outputs[0].cumulative_logprob == -1.5
    (d,), _ = proc.process([EngineCoreOutput(c0, [43], [{43: -1.0}], finish_reason="length")])
    assert d.finished and [c.index for c in d.outputs] == [0]


class Call:
    """One scripted replica call: yields `deltas`, then raises `then` (if any)."""

    def __init__(self, deltas: list[RequestOutput], then: BaseException | None = None) -> None:
        self.request_id, self.n = "r", 2
        self._deltas, self._then = list(deltas), then
        self.closed = False

    def __aiter__(self) -> Call:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._deltas:
            return self._deltas.pop(0)
        if self._then is not None:
            raise self._then
        raise StopAsyncIteration

    def close(self) -> None:
        self.closed = True


class Mover:
    """The service side of migration: the request goes on on replica 1 from its fold."""

    def __init__(self, second: Call) -> None:
        self.second = second
        self.resumes: list[RequestOutput | None] = []

    async def resubmit(
        self, stream: FleetStream, exclude: set[int]
    ) -> tuple[ReplicaStreamLike, int]:
        self.resumes.append(stream.state.resume_from())
        return self.second, 1

    def on_migrated(self, stream: FleetStream, error: ReplicaGoneError) -> None:
        pass


def test_one_request_state_across_a_migration() -> None:
    first = Call([delta({0: [1], 1: [10]}), delta({0: [2]})], then=ReplicaGoneError("died"))
    second = Call([delta({0: [3], 1: [11]}, finish={0: "length", 1: "length"})])
    mover = Mover(second)
    state = RequestState("r", 2, "interactive", 0, 0.0, OutputFold("r", 2), 0)
    stream = FleetStream(state, first, mover, migration_limit=1)

    async def main() -> list[RequestOutput]:
        return [d async for d in stream]

    got = asyncio.run(main())
    # The reader sees each token once; the move resumed from exactly what it had read.
    assert [c.token_ids for d in got for c in d.outputs] == [[1], [10], [2], [3], [11]]
    (resume,) = mover.resumes
    assert resume is not None and [c.token_ids for c in resume.outputs] == [[1, 2], [10]]
    assert first.closed and state.migrations == 1 and state.replicas_used == [0, 1]
    assert state.replica_index == 1 and state.ended and state.error is None
    whole = state.fold.output()
    assert [c.token_ids for c in whole.outputs] == [[1, 2, 3], [10, 11]] and whole.finished
    assert state.first_token_at is not None and state.num_outputs == 3


def test_a_stream_error_is_kept_in_the_state() -> None:
    state = RequestState("r", 2, "interactive", 0, 0.0, OutputFold("r", 2), 0)
    lost = ReplicaGoneError("died again")
    mover = Mover(Call([], then=lost))
    stream = FleetStream(state, Call([], then=ReplicaGoneError("died")), mover, migration_limit=1)

    async def main() -> None:
        async for _ in stream:
            pass

    with pytest.raises(EngineDeadError, match="migration_limit of 1"):
        asyncio.run(main())
    assert state.migrations == 1 and state.ended
    assert isinstance(state.error, EngineDeadError) and mover.resumes == [None]
