"""A request resumed from an output seen part-way (what migration sends to the new
replica) ends exactly as the undisturbed request did: token ids, text, logprobs, finish
reason, for greedy and seeded sampling, n > 1 (one choice already finished), and a stop
string; plus hedging: a copy sent when the first replica is slow wins, and the slow one
is aborted. Real engine processes of a tiny model."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from fleetserve.core.sampling_params import SamplingParams
from fleetserve.engine.arg_utils import EngineArgs
from fleetserve.engine.async_engine import AsyncEngine
from fleetserve.metrics import ServerMetrics
from fleetserve.outputs import OutputFold, RequestOutput, fold
from fleetserve.serve.admission.sla import ServiceClass
from fleetserve.serve.config.fleet_config import ModelEntry, ResilienceConfig
from fleetserve.serve.services.generate import GenerateService


def run(main: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(main(), 180))


async def outputs(engine: AsyncEngine, rid: str, params: SamplingParams, **kw: Any) -> list[Any]:
    """The request's answer so far after each of its deltas (folded, as migration folds
    them; a resumed request's fold starts from its `resume`)."""
    seen = []
    acc = OutputFold(rid, params.n, start=kw.get("resume"))
    async for out in engine.generate(rid, {"prompt_token_ids": PROMPT}, params, **kw):
        acc.add(out)
        seen.append(acc.output())
    return seen


PROMPT = [5, 17, 29, 41, 53, 65, 77, 89]

CASES = {
    "greedy+logprobs": SamplingParams(max_tokens=40, temperature=0.0, logprobs=2, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=40, temperature=1.0, seed=7, ignore_eos=True),
    "seeded n=2": SamplingParams(n=2, max_tokens=30, temperature=0.9, seed=3, ignore_eos=True),
    "penalties": SamplingParams(
        max_tokens=40,
        temperature=0.0,
        presence_penalty=1.5,
        frequency_penalty=0.5,
        repetition_penalty=1.2,
        ignore_eos=True,
    ),  # fmt: skip
}


def same(a: RequestOutput, b: RequestOutput) -> None:
    assert a.prompt_token_ids == b.prompt_token_ids
    for x, y in zip(a.outputs, b.outputs, strict=True):
        assert x.token_ids == y.token_ids
        assert x.text == y.text
        assert x.finish_reason == y.finish_reason
        if x.logprobs is not None:
            assert y.logprobs is not None and len(x.logprobs) == len(y.logprobs)
            for p, q in zip(x.logprobs, y.logprobs, strict=True):
                assert p.keys() == q.keys()
                assert all(abs(p[k] - q[k]) < 1e-4 for k in p)


@pytest.mark.parametrize("case", list(CASES))
def test_resumed_request_ends_as_undisturbed(tiny_llama: str, case: str) -> None:
    async def main() -> None:
        engine = AsyncEngine(EngineArgs(model=tiny_llama, num_threads=1), 64)
        await engine.start()
        try:
            params = CASES[case]
            ref = await outputs(engine, "ref", copy.copy(params))
            final = ref[-1]
            assert final.finished
            for cut in (1, len(ref) // 3, len(ref) - 2):
                seen = ref[cut]  # what the reader had when the replica was lost
                resumed = await outputs(engine, f"r{cut}", copy.copy(params), resume=seen)
                same(resumed[-1], final)
                # The first resumed output continues the seen one: nothing repeated.
                for c_seen, c_new in zip(seen.outputs, resumed[0].outputs, strict=True):
                    assert c_new.token_ids[: len(c_seen.token_ids)] == c_seen.token_ids
                    assert c_new.text.startswith(c_seen.text)
        finally:
            await engine.shutdown()

    run(main)


def test_resume_with_a_finished_choice_and_a_stop_string(tiny_llama: str) -> None:
    async def main() -> None:
        engine = AsyncEngine(EngineArgs(model=tiny_llama, num_threads=1), 64)
        await engine.start()
        try:
            probe = await outputs(engine, "probe", SamplingParams(max_tokens=30, temperature=0))
            text = probe[-1].outputs[0].text
            assert len(text) > 12
            stop = text[8:12]  # a stop string the greedy output meets part-way
            params = SamplingParams(max_tokens=30, temperature=0, stop=[stop])
            ref = await outputs(engine, "ref", copy.copy(params))
            assert ref[-1].outputs[0].finish_reason == "stop"
            # The last output before the stop: one C call may decode several tokens
            # (decode bursts), so the second output can be the final one already.
            seen = ref[min(1, len(ref) - 2)]
            assert not seen.finished
            resumed = await outputs(engine, "res", copy.copy(params), resume=seen)
            same(resumed[-1], ref[-1])
            # A finished output is refused: nothing of it is left to run (no hung stream).
            with pytest.raises(ValueError, match="resume"):
                engine.add_request("res-done", {"prompt_token_ids": PROMPT}, params, resume=ref[-1])
            # n=2 with different lengths: resume after the short choice has finished.
            params = SamplingParams(n=2, max_tokens=20, temperature=1.0, seed=11, ignore_eos=True)
            ref = await outputs(engine, "ref2", copy.copy(params))
            seen = copy.deepcopy(ref[len(ref) // 2])
            short = seen.outputs[0]
            short.token_ids = list(ref[-1].outputs[0].token_ids)  # choice 0 done already
            short.text, short.finish_reason = ref[-1].outputs[0].text, "length"
            resumed = await outputs(engine, "res2", copy.copy(params), resume=seen)
            same(resumed[-1], ref[-1])
        finally:
            await engine.shutdown()

    run(main)


def test_hedged_copy_wins_when_the_first_replica_is_slow(
    tiny_llama: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Replica 0 sleeps 1.5 s after every step: no first token before the hedge (0.3 s).
    monkeypatch.setenv("FLEETSERVE_DEBUG_STEP_DELAY_S", "0:1.5")

    async def main() -> None:
        classes = {"fast": ServiceClass("fast", hedge_after_s=0.3)}
        metrics = ServerMetrics().model("m")
        entry = ModelEntry(
            name="m", model=tiny_llama, engine={"max_num_seqs": 4, "num_threads": 1},
            replicas=2, routing="round_robin", resilience=ResilienceConfig(hang_timeout_s=None),
        )  # fmt: skip
        svc = GenerateService(entry, classes, "fast", metrics=metrics)
        await svc.start()
        try:
            params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
            streams = await svc.admit("h", [{"prompt_token_ids": PROMPT}], lambda: params)
            [stream] = streams
            assert stream.state.replica_index == 0  # round robin: the slow one first
            async for _ in stream:
                pass
            last = stream.state.fold.output()
            assert len(last.outputs[0].token_ids) == 12
            assert stream.state.hedged and stream.state.replica_index == 1
            slow = svc.replica_set.get(0)
            assert slow.num_outstanding_requests == 0  # the loser was aborted there
            # The same request unhedged on the fast replica gives the same tokens.
            ref = svc.replica_set.get(1).submit(
                "ref", {"prompt_token_ids": PROMPT}, copy.copy(params), 0, len(PROMPT)
            )
            final = fold([out async for out in ref])
            assert final.outputs[0].token_ids == last.outputs[0].token_ids
        finally:
            await svc.shutdown()

    run(main)
