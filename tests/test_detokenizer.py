"""Tokenizer wrapper and incremental detokenization."""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest

from fleetserve.detokenizer import IncrementalDetokenizer
from fleetserve.models.loader import resolve_model
from fleetserve.tokenizer import Tokenizer

MULTIBYTE_TEXT = "The cat saw 東京 and こんにちは 🙂🚀 at the café, naïve Straße ñandú 😀!"


@pytest.fixture(scope="module")
def tok(tiny_llama) -> Tokenizer:
    return Tokenizer.from_source(resolve_model(tiny_llama))


def _stream(tok: Tokenizer, prompt: list[int], ids: list[int], step: int = 1, **kw) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt, **kw)
    pieces = [detok.add_tokens(ids[i : i + step]) for i in range(0, len(ids), step)]
    pieces.append(detok.flush())
    assert detok.output_text == "".join(pieces)
    return pieces


def test_tokenizer_basics(tok):
    assert tok.vocab_size >= 256 + 3
    assert tok.eos_token_id == 2
    assert tok.stop_token_ids == {0, 2}  # <|im_end|> and generation_config's <|endoftext|>
    ids = tok.encode("The cat 東京")
    assert tok.decode(ids) == "The cat 東京"
    assert tok.convert_ids_to_tokens([1]) == ["<|im_start|>"]
    assert tok.decode([1, *ids, 2]) == "The cat 東京"
    assert tok.decode([1], skip_special_tokens=False) == "<|im_start|>"


def test_chat_template_ids_match_transformers(tok):
    messages = [{"role": "user", "content": "Hi there"}]
    expected = tok.transformers().apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True
    )
    if not isinstance(expected, list):  # transformers >= 5 returns a BatchEncoding
        expected = expected["input_ids"]
    ids = tok.apply_chat_template(messages)
    assert ids == list(expected)
    assert ids[0] == 1 and ids[-2:] == tok.encode("assistant\n")[-2:]


def test_missing_chat_template_is_a_value_error(tiny_llama, tmp_path):
    folder = tmp_path / "no-template"
    shutil.copytree(tiny_llama, folder)
    os.remove(folder / "chat_template.jinja")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_source(resolve_model(str(folder)))
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "Hi"}])


def test_multibyte_text_streams_without_partial_characters(tok):
    ids = tok.encode(MULTIBYTE_TEXT)
    # The test is only meaningful if some characters really span several tokens.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    pieces = _stream(tok, [], ids)
    assert pieces[-1] == ""  # nothing was held back at the end
    assert "".join(pieces) == MULTIBYTE_TEXT
    assert not any("\ufffd" in p for p in pieces)


def test_prompt_context_and_multi_token_steps(tok):
    prompt = tok.encode("<|im_start|>user\nSay 東京<|im_end|>\n")
    ids = tok.encode("Sure: 東京 🙂 is here.")
    full = tok.decode(prompt + ids)
    expected = full[len(tok.decode(prompt)) :]
    for step in (1, 2, 3, 7):
        assert "".join(_stream(tok, prompt, ids, step=step)) == expected


def test_random_ids_match_full_decode(tok):
    rng = random.Random(0)
    for trial in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        prompt = [rng.randrange(tok.vocab_size) for _ in range(trial % 4)]
        for skip in (True, False):
            pieces = _stream(tok, prompt, ids, skip_special_tokens=skip)
            full = tok.decode(prompt + ids, skip_special_tokens=skip)
            prefix = tok.decode(prompt, skip_special_tokens=skip)
            if full.startswith(prefix) and not prefix.endswith("\ufffd"):
                assert "".join(pieces) == full[len(prefix) :], (prompt, ids)
            if not prompt:
                assert "".join(pieces) == full, ids


def test_decodes_only_a_short_window(tok):
    calls = []
    decode = tok.decode

    def spy(ids, skip_special_tokens=True):
        calls.append(len(ids))
        return decode(ids, skip_special_tokens)

    tok_spy = Tokenizer(tok.hf)
    tok_spy.decode = spy  # type: ignore[method-assign]
    ids = tok.encode(MULTIBYTE_TEXT * 5)
    assert "".join(_stream(tok_spy, tok.encode("prompt " * 50), ids)) == MULTIBYTE_TEXT * 5
    assert max(calls) <= 8


def _metaspace_tokenizer() -> Tokenizer:
    """A SentencePiece-style tokenizer: its decoder drops the space before the first token of
    each decode call, which is why the detokenizer decodes with a window of context."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from fleetserve.models.make_model import training_corpus

    raw = RawTokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    raw.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"], show_progress=False)
    raw.train_from_iterator(training_corpus(), trainer=trainer)
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>"))


def test_leading_spaces_survive_with_a_metaspace_decoder():
    tok = _metaspace_tokenizer()
    prompt = tok.encode("The cat found")
    ids = tok.encode("The cat found the map before the storm")[len(prompt) :]
    assert tok.decode(ids[:1]) != tok.decode(prompt + ids[:1])[len(tok.decode(prompt)) :]
    assert "".join(_stream(tok, prompt, ids)) == " the map before the storm"
