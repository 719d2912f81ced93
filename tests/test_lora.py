"""LoRA adapters: greedy tokens equal HF transformers + peft on tiny random checkpoints
(several architectures, mixed-adapter batches with base rows, fewer slots than adapters,
an int8 base, tensor parallelism), the C kernel against the torch reference, the PEFT
checks, loading off the step loop, and adapters never sharing KV blocks."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fleetserve import LLM, SamplingParams
from fleetserve.core.block_manager import BlockManager
from fleetserve.core.config import SchedulerConfig
from fleetserve.core.request import Request
from fleetserve.core.scheduler import Scheduler
from fleetserve.engine.arg_utils import EngineArgs
from fleetserve.engine.core import EngineCore
from fleetserve.layers.quant_linear import QuantLinear
from fleetserve.lora import LoRARequest
from fleetserve.lora.adapter import load_adapter
from fleetserve.lora.kernel import _lib, apply_lora, group_rows
from helpers import write_tiny_gguf
from lora_helpers import make_adapter, peft_greedy, peft_logprobs

NUM_TOKENS = 8
PROMPTS = [
    [5, 17, 99, 230, 8],
    [40, 41, 42],
    [300, 2, 7, 9, 11, 13, 400, 401, 402, 17, 18, 19, 20, 21, 22, 23, 24, 25],
    [77, 78],
    [5, 17, 99, 230, 8],
]
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def arch_setup(
    request: pytest.FixtureRequest,
    tiny_model_factory: Callable[..., str],
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[str, dict[str, str]]:
    """A tiny base model and three adapters: all projections (r 8), attention + down only
    with rsLoRA (r 4), MLP only (r 6)."""
    base = tiny_model_factory(request.param)
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    adapters = {
        "all": make_adapter(base, root / "all", 1),
        "attn": make_adapter(
            base, root / "attn", 2, r=4, targets=["q_proj", "v_proj", "down_proj"], use_rslora=True
        ),
        "mlp": make_adapter(
            base, root / "mlp", 3, r=6, alpha=3.0, targets=["gate_proj", "up_proj", "down_proj"]
        ),
    }
    return base, adapters


def _mixed(adapters: dict[str, str]) -> list[LoRARequest | None]:
    ids = {name: i + 1 for i, name in enumerate(adapters)}
    names = ["all", None, "attn", "mlp", "all"]
    return [None if n is None else LoRARequest(n, ids[n], adapters[n]) for n in names]


@pytest.mark.parametrize("max_loras", [1, 3])
def test_mixed_batch_matches_peft(arch_setup: tuple[str, dict[str, str]], max_loras: int) -> None:
    """One generate call mixing three adapters and the base model; with max_loras=1 the
    adapters take turns in the one slot (and the CPU cache holds 2 of 3: evictions)."""
    base, adapters = arch_setup
    loras = _mixed(adapters)
    llm = LLM(
        base,
        enable_lora=True,
        max_loras=max_loras,
        max_cpu_loras=max(2, max_loras),
        max_lora_rank=8,
        max_model_len=128,
    )
    outs = llm.generate(PROMPTS, GREEDY, lora_request=loras, use_tqdm=False)
    base_tokens = {}
    for p, lora, out in zip(PROMPTS, loras, outs, strict=True):
        want = peft_greedy(base, lora.lora_path if lora else None, p, NUM_TOKENS)
        assert out.outputs[0].token_ids == want, (lora, p)
        if lora is None:
            base_tokens[tuple(p)] = want
    # The adapters change the output (B is not zero), so the test could fail.
    assert outs[0].outputs[0].token_ids != peft_greedy(base, None, PROMPTS[0], NUM_TOKENS)
    assert outs[2].outputs[0].token_ids != peft_greedy(base, None, PROMPTS[2], NUM_TOKENS)
    cache = llm.engine.core.lora
    assert cache is not None
    if max_loras == 1:
        assert sum(cache.stats.evictions.values()) >= 1


def test_torch_reference_path_matches_peft(arch_setup: tuple[str, dict[str, str]]) -> None:
    """The plain-torch path (no C kernels) gives the same tokens."""
    base, adapters = arch_setup
    loras = _mixed(adapters)
    llm = LLM(
        base, enable_lora=True, max_loras=3, max_lora_rank=8, attention_backend="torch",
        max_model_len=128,
    )  # fmt: skip
    runner = llm.engine.core.executor.runner  # type: ignore[attr-defined]
    for module, _ in runner.lora.modules:
        module.use_c = False
    outs = llm.generate(PROMPTS[:3], GREEDY, lora_request=loras[:3], use_tqdm=False)
    for p, lora, out in zip(PROMPTS, loras, outs, strict=False):
        assert out.outputs[0].token_ids == peft_greedy(
            base, lora.lora_path if lora else None, p, NUM_TOKENS
        )


def _assert_close_to_peft(llm: LLM, base: str, adapter: str) -> None:
    """The quantized parity tests' rule against HF + peft in float32: top-1 agreement
    >= 0.95 over the prompt positions, mean |dlogprob| < 0.1."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 512, (96,), generator=g).tolist()
    lora = LoRARequest("all", 1, adapter)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    out = llm.generate({"prompt_token_ids": ids}, params, lora_request=lora, use_tqdm=False)[0]
    assert out.prompt_logprobs is not None
    rows = out.prompt_logprobs[1:]
    got = torch.tensor([row[t] for row, t in zip(rows, ids[1:], strict=True)])  # type: ignore[index]
    got_top = [max(row, key=row.__getitem__) for row in rows]  # type: ignore[union-attr]
    ref = peft_logprobs(base, adapter, ids)[:-1]
    want = ref.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    want_top = ref.argmax(-1).tolist()
    agree = sum(a == b for a, b in zip(got_top, want_top, strict=True)) / len(want_top)
    assert agree >= 0.95, agree
    assert float((got - want).abs().mean()) < 0.1


def test_int8_base_stays_close_to_peft(arch_setup: tuple[str, dict[str, str]]) -> None:
    base, adapters = arch_setup
    llm = LLM(base, quantization="int8", enable_lora=True, max_lora_rank=8, max_model_len=128)
    model = llm.engine.core.executor.runner.model  # type: ignore[attr-defined]
    assert isinstance(model.model.layers[0].mlp.gate_up_proj.base, QuantLinear)
    _assert_close_to_peft(llm, base, adapters["all"])


def test_gguf_base_stays_close_to_peft(
    tiny_model_factory: Callable[..., str], tmp_path: Path
) -> None:
    """A GGUF base (Q8_0 MLP blocks kept quantized, float32 attention)."""
    base = tiny_model_factory("llama")
    gguf_path = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(base, gguf_path)
    adapter = make_adapter(base, tmp_path / "a", 1)
    llm = LLM(gguf_path, enable_lora=True, max_lora_rank=8, max_model_len=128)
    model = llm.engine.core.executor.runner.model  # type: ignore[attr-defined]
    assert isinstance(model.model.layers[0].mlp.down_proj.base, QuantLinear)
    _assert_close_to_peft(llm, base, adapter)


def test_tensor_parallel_matches_peft(tiny_model_factory: Callable[..., str], tmp_path: Path):
    """TP=2: q/k/v and gate/up adapters cut by output rows, o/down by input columns."""
    base = tiny_model_factory("llama")
    a = make_adapter(base, tmp_path / "a", 5)
    llm = LLM(base, tensor_parallel_size=2, enable_lora=True, max_lora_rank=8, max_model_len=128)
    loras = [LoRARequest("a", 1, a), None]
    outs = llm.generate(PROMPTS[:2], GREEDY, lora_request=loras, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == peft_greedy(base, a, PROMPTS[0], NUM_TOKENS)
    assert outs[1].outputs[0].token_ids == peft_greedy(base, None, PROMPTS[1], NUM_TOKENS)


def test_lora_dtype_float32_exact_bfloat16_close(
    tiny_model_factory: Callable[..., str], tmp_path: Path
) -> None:
    """An adapter whose values are not bf16 values: float32 slots give HF + peft's
    greedy tokens exactly; bf16 slots (the default with the C kernel) stay within the
    quantized parity tests' tolerance. (The other tests' adapters, std 0.3 on A and B of
    every projection, swamp the tiny base; at std 0.1 the adapter still moves HF's mean
    log-prob by far more than the tolerance, so the test can fail.)"""
    base = tiny_model_factory("llama")
    adapter = make_adapter(base, tmp_path / "a", 9, bf16_exact=False, std=0.1)
    want = peft_greedy(base, adapter, PROMPTS[2], NUM_TOKENS)
    for lora_dtype, slot_dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        llm = LLM(base, enable_lora=True, max_lora_rank=8, max_model_len=128, lora_dtype=lora_dtype)
        runner = llm.engine.core.executor.runner  # type: ignore[attr-defined]
        assert runner.lora.dtype == slot_dtype
        if lora_dtype == "float32":
            lora = LoRARequest("all", 1, adapter)
            out = llm.generate([PROMPTS[2]], GREEDY, lora_request=lora, use_tqdm=False)[0]
            assert out.outputs[0].token_ids == want
        else:
            _assert_close_to_peft(llm, base, adapter)
        del llm
    with pytest.raises(ValueError, match="lora_dtype"):
        LLM(base, enable_lora=True, lora_dtype="float8")


# ------------------------------------------------------------------- the kernel
@pytest.mark.skipif(_lib() is None, reason="no C compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [3, 40])
def test_kernel_matches_torch_reference(num_rows: int, dtype: torch.dtype) -> None:
    """float32 or bfloat16 slots (the math is float32 in both paths)."""
    g = torch.Generator().manual_seed(0)
    slots, max_rank, in_dim, segs = 3, 8, 37, [20, 6, 6]
    a = torch.randn(slots, len(segs) * max_rank, in_dim, generator=g)
    b = torch.randn(slots, max_rank, sum(segs), generator=g)
    ranks = torch.tensor([[8, 4, 0], [2, 2, 2], [0, 8, 1]], dtype=torch.int32)
    # The torch reference multiplies everything: zero what is past each rank.
    for s in range(slots):
        for seg in range(len(segs)):
            r = int(ranks[s, seg])
            a[s, seg * max_rank + r : (seg + 1) * max_rank] = 0
            lo = sum(segs[:seg])
            b[s, r:, lo : lo + segs[seg]] = 0
    starts = torch.tensor([0, 20, 26, 32])
    a, b = a.to(dtype), b.to(dtype)
    x = torch.randn(num_rows, in_dim, generator=g)
    row_slots = [None if i % 4 == 3 else (i * 7) % slots for i in range(num_rows)]
    groups = group_rows(row_slots)
    assert groups is not None
    y0 = torch.randn(num_rows, sum(segs), generator=g)
    y_c, y_t = y0.clone(), y0.clone()
    apply_lora(x, y_c, a, b, ranks, starts, groups, use_c=True)
    apply_lora(x, y_t, a, b, ranks, starts, groups, use_c=False)
    torch.testing.assert_close(y_c, y_t, rtol=1e-5, atol=1e-4)
    base_rows = [i for i, s in enumerate(row_slots) if s is None]
    assert torch.equal(y_c[base_rows], y0[base_rows])


# ----------------------------------------------------------------- bad adapters
def test_bad_adapters_are_refused_by_name(
    arch_setup: tuple[str, dict[str, str]], tiny_model_factory: Callable[..., str], tmp_path: Path
) -> None:
    base, adapters = arch_setup
    cfg = EngineArgs(model=base, max_model_len=128).resolve()[0].model
    with pytest.raises(ValueError, match="not a PEFT adapter folder"):
        load_adapter("x", str(tmp_path), cfg, 16)
    with pytest.raises(ValueError, match="rank 8 .* above max_lora_rank=4"):
        load_adapter("big", adapters["all"], cfg, 4)
    head = make_adapter(base, tmp_path / "head", 4, targets=["q_proj", "lm_head"])
    with pytest.raises(ValueError, match="'head'.*no LoRA place"):
        load_adapter("head", head, cfg, 16)
    other = tiny_model_factory("llama", hidden_size=96)
    mismatch = make_adapter(other, tmp_path / "other", 4, targets=["q_proj"])
    with pytest.raises(ValueError, match="another base model"):
        load_adapter("other", mismatch, cfg, 16)
    dora = tmp_path / "dora"
    dora.mkdir()
    (dora / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "use_dora": True}))
    (dora / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="DoRA"):
        load_adapter("dora", str(dora), cfg, 16)
    llm = LLM(base, max_model_len=128)
    with pytest.raises(ValueError, match="without enable_lora"):
        llm.generate([1, 2, 3], GREEDY, lora_request=LoRARequest("all", 1, adapters["all"]))


def test_failed_load_rejects_its_requests_only(arch_setup: tuple[str, dict[str, str]], tmp_path):
    """In the engine core a load runs off the loop; a bad folder fails its requests with
    the loader's message while the others run on."""
    base, adapters = arch_setup
    config, source = EngineArgs(
        model=base, enable_lora=True, max_lora_rank=8, max_model_len=128
    ).resolve()
    core = EngineCore(config, source)
    core.add_request(
        Request("ok", PROMPTS[0], GREEDY, lora_request=LoRARequest("all", 1, adapters["all"]))
    )
    core.add_request(
        Request("bad", PROMPTS[1], GREEDY, lora_request=LoRARequest("bad", 2, str(tmp_path)))
    )
    core.add_request(Request("base", PROMPTS[1], GREEDY))
    # Both adapters are loading: only the base request is in the scheduler.
    assert set(core.scheduler.requests) == {"base"}
    done: dict[str, list[int]] = {"ok": [], "base": []}
    rejected: list[tuple[str, str]] = []
    for _ in range(2000):
        if not core.has_unfinished_requests():
            break
        for out in core.step():
            done[out.req_id] += out.new_token_ids
        rejected += core.take_rejected()
    assert [r for r, _ in rejected] == ["bad"]
    assert "not a PEFT adapter folder" in rejected[0][1]
    assert done["ok"] == peft_greedy(base, adapters["all"], PROMPTS[0], NUM_TOKENS)
    assert done["base"] == peft_greedy(base, None, PROMPTS[1], NUM_TOKENS)
    core.shutdown()


# --------------------------------------------------------------- the core's rules
def test_adapters_never_share_kv_blocks() -> None:
    """Same tokens, different adapters: no prefix-cache hit; same adapter: its blocks."""
    bm = BlockManager(num_blocks=16, block_size=4)
    sp = SamplingParams(max_tokens=4)
    tokens = list(range(100, 113))  # 3 full blocks + 1 token
    a, b = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")

    def run(req_id: str, lora: LoRARequest | None) -> tuple[list[int], list[int]]:
        req = Request(req_id, tokens, sp, lora_request=lora)
        hits, _ = bm.get_computed_blocks(req)
        assert bm.allocate_slots(req, len(tokens) - len(hits) * 4, hits)
        req.num_computed_tokens = len(tokens)
        bm.cache_full_blocks(req)
        held = list(bm.block_ids(req_id))
        bm.free(req)
        return hits, held

    # A freed request's unhashed last block goes to the head of the free queue (it is
    # taken first); its hashed blocks to the tail.
    assert run("a1", a) == ([], [0, 1, 2, 3])
    assert run("b1", b) == ([], [3, 4, 5, 6])  # a's cached blocks 0-2 are not b's hits
    assert run("base", None) == ([], [6, 7, 8, 9])
    assert run("a2", a) == ([0, 1, 2], [0, 1, 2, 9])
    assert run("b2", b) == ([3, 4, 5], [3, 4, 5, 9])
    # The same name from another folder is another adapter.
    assert run("a3", LoRARequest("a", 1, "/a-v2"))[0] == []
    bm.check_invariants()


def test_scheduler_runs_at_most_max_loras_adapters() -> None:
    sched = Scheduler(SchedulerConfig(max_loras=2), BlockManager(64, 4))
    sp = SamplingParams(max_tokens=4)
    for i, name in enumerate(["a", "b", "c", "a", None]):
        lora = None if name is None else LoRARequest(name, 1, f"/{name}")
        sched.add_request(Request(str(i), [1, 2, 3], sp, lora_request=lora))
    out = sched.schedule()
    # "c" waits for a slot; a second "a" request and the base request join.
    assert set(out.num_scheduled_tokens) == {"0", "1", "3", "4"}
    assert [r.lora_name for r in out.scheduled_new_reqs] == ["a", "b", "a", None]
    sched.finish_requests(["1"], sched.requests["1"].status.FINISHED_ABORTED)
    assert set(sched.schedule().num_scheduled_tokens) == {"0", "2", "3", "4"}


@pytest.mark.parametrize("arch", ["mistral", "qwen3", "gemma3", "mixtral"])
def test_more_architectures_match_peft(
    arch: str, tiny_model_factory: Callable[..., str], tmp_path: Path
) -> None:
    """A mixed batch (two adapters and the base) on the other families the engine serves;
    on a mixture-of-experts model adapters go on the attention projections (its MLP
    targets are refused by name)."""
    base = tiny_model_factory(arch)
    moe = arch == "mixtral"
    attn = ["q_proj", "k_proj", "v_proj", "o_proj"]
    paths = [
        make_adapter(base, tmp_path / "one", 1, targets=attn if moe else None),
        make_adapter(base, tmp_path / "two", 2, r=4, targets=["q_proj", "v_proj"]),
    ]
    loras = [LoRARequest("one", 1, paths[0]), None, LoRARequest("two", 2, paths[1])]
    llm = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=8, max_model_len=128)
    outs = llm.generate(PROMPTS[:3], GREEDY, lora_request=loras, use_tqdm=False)
    for p, lora, out in zip(PROMPTS, loras, outs, strict=False):
        want = peft_greedy(base, lora.lora_path if lora else None, p, NUM_TOKENS)
        assert out.outputs[0].token_ids == want, (arch, lora)
    assert outs[0].outputs[0].token_ids != peft_greedy(base, None, PROMPTS[0], NUM_TOKENS)
    if moe:
        from fleetserve.bench.lora import write_random_adapter

        cfg = llm.engine.core.config.model  # type: ignore[attr-defined]
        mlp = write_random_adapter(cfg, tmp_path / "mlp", 4, 3, ("q_proj", "gate_proj"))
        with pytest.raises(ValueError, match="'gate_proj'.*mixture-of-experts"):
            load_adapter("mlp", mlp, cfg, 8)
