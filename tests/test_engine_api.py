"""LLM.generate end to end on a tiny checkpoint: output shape and order, stop conditions,
and bad input rejected with a ValueError that names the field, leaving the engine usable."""

from __future__ import annotations

from typing import Any

import pytest

from fleetserve import LLM, SamplingParams
from fleetserve.core.request import Request
from fleetserve.outputs import OutputFold

MAX_MODEL_LEN = 64
PROMPTS = [
    "the cat found",
    "a small dog painted the long river",
    "my friend",
    "the old sailor watched a quiet garden near the station",
    "our teacher counted",
    "the robot built",
    "every student",
    "the king cooked",
]


@pytest.fixture(scope="module")
def llm(tiny_llama: str) -> LLM:
    return LLM(model=tiny_llama, max_model_len=MAX_MODEL_LEN)


def greedy(**kw: Any) -> SamplingParams:
    kw.setdefault("max_tokens", 12)
    return SamplingParams(temperature=0.0, **kw)


def gen(llm: LLM, prompts: Any, params: Any) -> list:
    return llm.generate(prompts, params, use_tqdm=False)


def test_generate_returns_outputs_in_input_order(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    # Different max_tokens so the requests finish in a different order than added.
    params = [greedy(max_tokens=m, ignore_eos=True) for m in (9, 2, 6)]
    outs = gen(llm, PROMPTS[:3], params)
    assert [o.prompt for o in outs] == PROMPTS[:3]
    assert len({o.request_id for o in outs}) == 3
    for o, p, sp in zip(outs, PROMPTS[:3], params, strict=True):
        assert o.finished
        assert o.prompt_token_ids == tok.encode(p)
        assert len(o.outputs) == 1
        c = o.outputs[0]
        assert c.index == 0
        assert len(c.token_ids) == sp.max_tokens
        assert c.finish_reason == "length"
        # Trailing bytes of an unfinished UTF-8 character are not shown.
        decoded = tok.transformers().decode(c.token_ids, skip_special_tokens=True)
        assert decoded.startswith(c.text) and set(decoded[len(c.text) :]) <= {"\ufffd"}
    # The same prompt alone gives the same tokens (batching does not change greedy output).
    alone = gen(llm, PROMPTS[0], params[0])
    assert alone[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_token_id_prompts_and_n_siblings(llm: LLM) -> None:
    ids = llm.get_tokenizer().encode(PROMPTS[1])
    by_ids = gen(llm, {"prompt_token_ids": ids}, greedy(n=3, ignore_eos=True))[0]
    by_text = gen(llm, PROMPTS[1], greedy(ignore_eos=True))[0]
    assert by_ids.prompt_token_ids == ids
    assert [c.index for c in by_ids.outputs] == [0, 1, 2]
    for c in by_ids.outputs:
        assert c.token_ids == by_text.outputs[0].token_ids


def _first_unique(items: list[Any], start: int) -> int:
    for i in range(start, len(items)):
        if items[i] not in items[:i]:
            return i
    raise AssertionError(f"no item seen for the first time after {start} in {items}")


def test_max_tokens_ends_with_length(llm: LLM) -> None:
    out = gen(llm, PROMPTS[3], greedy(max_tokens=5, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    assert out.stop_reason is None


def test_stop_token_ids(llm: LLM) -> None:
    full = gen(llm, PROMPTS[3], greedy(ignore_eos=True))[0].outputs[0].token_ids
    i = _first_unique(full, 3)
    out = gen(llm, PROMPTS[3], greedy(ignore_eos=True, stop_token_ids=[full[i]]))[0].outputs[0]
    assert out.token_ids == full[: i + 1]
    assert out.finish_reason == "stop" and out.stop_reason == full[i]


def _stop_string_case(llm: LLM) -> tuple[str, str, int]:
    """A prompt whose greedy text has a 2-character ASCII substring first seen mid-text."""
    for p in PROMPTS:
        text = gen(llm, p, greedy(ignore_eos=True, max_tokens=16))[0].outputs[0].text
        for i in range(3, len(text) - 3):
            s = text[i : i + 2]
            if s.isascii() and s.isalnum() and text.find(s) == i:
                return p, text, i
    raise AssertionError("no usable stop string in the tiny model's outputs")


def test_stop_strings_are_excluded_from_text(llm: LLM) -> None:
    prompt, text, i = _stop_string_case(llm)
    s = text[i : i + 2]
    out = gen(llm, prompt, greedy(ignore_eos=True, max_tokens=16, stop=[s, "never-seen"]))[0]
    c = out.outputs[0]
    assert c.text == text[:i]
    assert c.finish_reason == "stop" and c.stop_reason == s
    assert len(c.token_ids) < 16
    kept = gen(
        llm, prompt, greedy(ignore_eos=True, max_tokens=16, stop=s, include_stop_str_in_output=True)
    )[0].outputs[0]
    assert kept.text == text[: i + 2]


def _eos_case(llm: LLM) -> tuple[str, list[int]]:
    """A prompt whose greedy continuation ends on EOS, with its tokens."""
    eos = set(llm.engine.eos_token_ids)
    for p in PROMPTS:
        c = gen(llm, p, greedy(max_tokens=16))[0].outputs[0]
        if c.finish_reason == "stop" and len(c.token_ids) >= 3:
            assert c.token_ids[-1] in eos and c.stop_reason is None
            return p, c.token_ids
    raise AssertionError("no prompt's greedy continuation reaches EOS; pick other prompts")


def test_eos_stops_unless_ignore_eos(llm: LLM) -> None:
    prompt, tokens = _eos_case(llm)
    assert all(t not in llm.engine.eos_token_ids for t in tokens[:-1])
    ignored = gen(llm, prompt, greedy(max_tokens=16, ignore_eos=True))[0].outputs[0]
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == 16
    assert ignored.token_ids[: len(tokens)] == tokens


def test_min_tokens_defers_eos(llm: LLM) -> None:
    prompt, tokens = _eos_case(llm)
    k = len(tokens) + 2
    out = gen(llm, prompt, greedy(max_tokens=16, min_tokens=k))[0].outputs[0]
    eos = set(llm.engine.eos_token_ids)
    # EOS cannot be generated before min_tokens (vLLM's contract), so the first k tokens
    # hold none; the output runs at least k tokens.
    assert len(out.token_ids) >= k
    assert not eos & set(out.token_ids[:k])
    # Stop strings are deferred too.
    prompt_s, text, i = _stop_string_case(llm)
    c = gen(
        llm, prompt_s, greedy(ignore_eos=True, max_tokens=16, min_tokens=16, stop=[text[i : i + 2]])
    )[0].outputs[0]
    assert len(c.token_ids) == 16 and c.finish_reason == "length"


# ----------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logprobs": 21}, "logprobs"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop": "\udbff"}, "stop"),
        ({"stop": ["ok", "\ud800"]}, "stop"),
    ],
)
def test_bad_sampling_params_name_the_field(kw: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**kw)


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ("the cat", SamplingParams(max_tokens=MAX_MODEL_LEN), "max_model_len"),
        ({"prompt_token_ids": list(range(3, 3 + MAX_MODEL_LEN))}, None, "max_model_len"),
        ("", None, "prompt"),
        ({"prompt_token_ids": []}, None, "prompt_token_ids"),
        ({"prompt_token_ids": [5, 100_000]}, None, "vocab"),
        ({"prompt_token_ids": [5, -1]}, None, "vocab"),
        ("the cat", SamplingParams(stop_token_ids=[100_000]), "stop_token_ids"),
        ("the \ud800 cat", None, "^prompt .*Unicode"),
        ({"prompt": "a\udfff"}, None, "^prompt .*Unicode"),
        ({"prompt_token_ids": [5, 6], "prompt": "\ud800"}, None, "^prompt .*Unicode"),
    ],
)
def test_bad_requests_raise_and_leave_the_engine_usable(
    llm: LLM, prompt: Any, params: SamplingParams | None, match: str
) -> None:
    engine = llm.engine
    good = greedy(max_tokens=6, ignore_eos=True)
    expected = gen(llm, PROMPTS[4], good)[0].outputs[0].token_ids
    engine.add_request("good", PROMPTS[4], good)
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", prompt, params)
    assert engine.output_processor.child_ids("bad") == []
    finished = {}
    folds: dict[str, OutputFold] = {}
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():  # deltas: folded per request
            folds.setdefault(out.request_id, OutputFold(out.request_id)).add(out)
            if out.finished:
                finished[out.request_id] = folds[out.request_id].output()
    assert list(finished) == ["good"]
    assert finished["good"].outputs[0].token_ids == expected
    bm = engine.core.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks
    # A batch with one bad prompt raises before running anything; the next batch works.
    with pytest.raises(ValueError, match=match):
        gen(llm, [PROMPTS[4], prompt], [good, params or SamplingParams()])
    assert not engine.has_unfinished_requests()
    assert gen(llm, PROMPTS[4], good)[0].outputs[0].token_ids == expected


def test_core_rejects_out_of_vocab_tokens(llm: LLM) -> None:
    core = llm.engine.core
    with pytest.raises(ValueError, match="vocab"):
        core.add_request(Request("x", [1, core.config.model.vocab_size], SamplingParams()))
    assert not core.has_unfinished_requests()


def test_unknown_dtype_is_rejected(tiny_llama: str) -> None:
    with pytest.raises(ValueError, match="dtype"):
        LLM(model=tiny_llama, dtype="float8")


def test_duplicate_request_id_is_rejected(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("dup", PROMPTS[0], greedy(max_tokens=2))
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("dup", PROMPTS[1], greedy(max_tokens=2))
    engine.abort_request("dup")
    assert not engine.has_unfinished_requests()
    assert engine.core.block_manager.num_free_blocks == engine.core.block_manager.num_blocks
