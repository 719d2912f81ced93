"""LoRA through the server's engine path: AsyncEngine -> wire -> engine-core process.

Adapters load in the core's loader thread while the base model's requests run; a bad
folder fails only its own request; a resumed (migrated) request keeps its adapter; the
core reports which adapters it holds and the per-adapter metrics count them."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from fleetserve.core.sampling_params import SamplingParams
from fleetserve.engine.arg_utils import EngineArgs
from fleetserve.engine.async_engine import AsyncEngine
from fleetserve.lora import LoRARequest
from fleetserve.metrics import ServerMetrics
from fleetserve.outputs import OutputFold
from lora_helpers import make_adapter, peft_greedy

PROMPT = [5, 17, 29, 41, 53, 65, 77, 89]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def run(main: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(main(), 180))


async def outputs(engine: AsyncEngine, rid: str, **kw: Any) -> list[Any]:
    """The whole answer after each of the stream's deltas (folded as they come)."""
    seen = []
    params = copy.copy(GREEDY)
    resume = kw.get("resume")
    whole = OutputFold(rid, start=resume)
    async for out in engine.generate(rid, {"prompt_token_ids": PROMPT}, params, **kw):
        whole.add(out)
        seen.append(whole.output())
    return seen


def test_adapters_through_the_core_process(tiny_llama: str, tmp_path: Path) -> None:
    a = make_adapter(tiny_llama, tmp_path / "a", 11)
    b = make_adapter(tiny_llama, tmp_path / "b", 12, r=4, targets=["q_proj", "o_proj"])
    la, lb = LoRARequest("a", 1, a), LoRARequest("b", 2, b)
    server = ServerMetrics()

    async def main() -> None:
        args = EngineArgs(
            model=tiny_llama, num_threads=1, enable_lora=True, max_loras=2, max_lora_rank=8
        )
        engine = AsyncEngine(args, 64, metrics=server.model("m"))
        await engine.start()
        try:
            got = await asyncio.gather(
                outputs(engine, "a", lora_request=la),
                outputs(engine, "base"),
                outputs(engine, "b", lora_request=lb),
            )
            for seen, path in zip(got, [a, None, b], strict=True):
                assert seen[-1].outputs[0].token_ids == peft_greedy(tiny_llama, path, PROMPT, 12)
            assert engine.lora_loaded == {"a", "b"}
            # Migration: resumed from a cut on another engine, the adapter goes with it.
            ref = got[0]
            resumed = await outputs(engine, "a2", lora_request=la, resume=ref[3])
            assert resumed[-1].outputs[0].token_ids == ref[-1].outputs[0].token_ids
            # A bad folder fails its own request with the loader's message.
            with pytest.raises(ValueError, match="not a PEFT adapter folder"):
                await outputs(engine, "bad", lora_request=LoRARequest("bad", 3, str(tmp_path)))
            assert (await outputs(engine, "base2"))[-1].outputs[0].token_ids == got[1][-1].outputs[
                0
            ].token_ids
        finally:
            await engine.shutdown()

    run(main)
    text = server.render().decode()
    # A resumed request is not a new one (its tokens count where they are generated).
    assert 'fleetserve:lora_requests_total{lora_name="a",model_name="m"} 1.0' in text
    assert 'fleetserve:lora_requests_total{lora_name="bad",model_name="m"} 1.0' in text
    assert 'fleetserve:lora_loads_total{lora_name="b",model_name="m"} 1.0' in text
    assert 'fleetserve:lora_generation_tokens_total{lora_name="b",model_name="m"} 12.0' in text
