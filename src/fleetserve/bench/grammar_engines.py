"""`python -m fleetserve.bench.grammar_engines`: the grammar engines fleetserve could use,
on SmolLM2's 49k vocabulary: tokenizer tables, compile time of a realistic JSON schema,
and the time to fill one token mask per step along a valid answer. llguidance is the one
fleetserve uses; xgrammar and outlines-core are measured when installed (they are not
dependencies: `pip install --target DIR xgrammar apache-tvm-ffi outlines-core`, then
PYTHONPATH=DIR).
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

from fleetserve.bench.structured import ORDER_SCHEMA

ANSWER = {
    "order_id": "ORD-123456",
    "customer": {"name": "Ada Lovelace", "email": "ada@example.com", "tier": "pro"},
    "items": [
        {"sku": "HAM-001", "name": "Claw hammer", "quantity": 2, "unit_price": 19.5},
        {"sku": "NAI-250", "name": "Nails, 250", "quantity": 10, "unit_price": 3.25},
    ],
    "express": True,
    "notes": "Leave at the back door.",
}


def _ms(seconds: float) -> float:
    return round(1e3 * seconds, 3)


def _per_step(fill: Any, accept: Any, ids: list[int]) -> dict[str, float]:
    times = []
    for t in ids:
        t0 = time.perf_counter()
        fill()
        times.append(time.perf_counter() - t0)
        assert accept(t), t
    return {
        "mask_mean_us": round(1e6 * statistics.mean(times), 1),
        "mask_p50_us": round(1e6 * statistics.median(times), 1),
        "mask_max_us": round(1e6 * max(times), 1),
    }


def bench_llguidance(hf: Any, ids: list[int]) -> dict[str, Any]:
    import llguidance
    import llguidance.hf
    import llguidance.numpy as lnp

    from fleetserve.structured.grammars import JSON_OPTIONS

    t0 = time.perf_counter()
    tok = llguidance.hf.from_tokenizer(hf)
    t1 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(ORDER_SCHEMA, defaults=JSON_OPTIONS)
    m = llguidance.LLMatcher(tok, grammar)
    t2 = time.perf_counter()
    bits = lnp.allocate_token_bitmask(1, tok.vocab_size)
    out = {"tokenizer_ms": _ms(t1 - t0), "compile_ms": _ms(t2 - t1)}
    out.update(_per_step(lambda: lnp.fill_next_token_bitmask(m, bits, 0), m.consume_token, ids))
    return out


def bench_xgrammar(hf: Any, ids: list[int]) -> dict[str, Any]:
    import xgrammar as xg

    t0 = time.perf_counter()
    compiler = xg.GrammarCompiler(xg.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf)))
    t1 = time.perf_counter()
    m = xg.GrammarMatcher(compiler.compile_json_schema(json.dumps(ORDER_SCHEMA)))
    t2 = time.perf_counter()
    bits = xg.allocate_token_bitmask(1, len(hf))
    out = {"tokenizer_ms": _ms(t1 - t0), "compile_ms": _ms(t2 - t1)}
    out.update(_per_step(lambda: m.fill_next_token_bitmask(bits), m.accept_token, ids))
    return out


def bench_outlines_core(hf: Any, ids: list[int]) -> dict[str, Any]:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    eos = hf.eos_token_id
    t0 = time.perf_counter()
    vocab: dict[str, list[int]] = {}
    for token, i in hf.get_vocab().items():
        if i != eos:
            vocab.setdefault(token, []).append(i)
    v = Vocabulary(eos, vocab)
    t1 = time.perf_counter()
    index = Index(build_regex_from_schema(json.dumps(ORDER_SCHEMA)), v)
    t2 = time.perf_counter()
    guide = Guide(index)
    out = {"tokenizer_ms": _ms(t1 - t0), "compile_ms": _ms(t2 - t1)}
    # Its index is built ahead of time: a step is a table lookup (first steps only; the
    # byte-level vocabulary is not decoded here, so later answers' tokens may not match).
    times = []
    for _ in ids[:5]:
        t = time.perf_counter()
        guide.get_tokens()
        times.append(time.perf_counter() - t)
    out["mask_mean_us"] = round(1e6 * statistics.mean(times), 1)
    return out


def main() -> None:
    from fleetserve.models.default_model import default_model_path
    from fleetserve.models.loader import resolve_model
    from fleetserve.tokenizer import Tokenizer

    hf = Tokenizer.from_source(resolve_model(default_model_path())).transformers()
    ids = hf.encode(json.dumps(ANSWER, separators=(",", ":")), add_special_tokens=False)
    for name, fn in [
        ("llguidance", bench_llguidance),
        ("xgrammar", bench_xgrammar),
        ("outlines-core", bench_outlines_core),
    ]:
        try:
            print(json.dumps({name: fn(hf, ids)}), flush=True)
        except ImportError as e:
            print(json.dumps({name: f"not installed ({e.name})"}), flush=True)


if __name__ == "__main__":
    main()
