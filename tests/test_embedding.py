"""all-MiniLM-L6-v2 through fleetserve's BERT against sentence-transformers on the same folder."""

from __future__ import annotations

import os

# sentence-transformers must load from the local folder and never reach the hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from typing import Any

import numpy as np
import pytest

from fleetserve.engine.embedding import (
    MINILM_NAME,
    EmbeddingModel,
    resolve_embedding_model,
)

LONG = " ".join(f"word{i} of a very long document that keeps going" for i in range(80))
SENTENCES = [
    "Hello world",
    "a",
    "   ",
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France?",
    "Paris is the capital and most populous city of France.",
    "I love pizza!!! 🍕🍕🍕",
    "¿Dónde está la biblioteca? Está cerca de la estación.",
    "Größenwahn und Übermut — Straße, Maß, Fuß.",
    "東京は日本の首都です。",
    "Москва — столица России.",
    "مرحبا بالعالم",
    "!!!???...,,,;;;:::",
    "(nested (parentheses [and {brackets}]))",
    "e-mail: someone@example.com, url: https://example.com/a?b=c&d=e#f",
    "3.14159 26535 89793 23846 26433 83279",
    "CamelCaseIdentifiersAndsnake_case_names_in_code()",
    "def f(x):\n    return x ** 2  # squares\n",
    "tab\tseparated\tvalues\tand\nnew\nlines",
    "Don't won't can't shouldn't y'all'd've",
    "A sentence with    irregular     spacing.",
    "ALL CAPS SHOUTING SENTENCE HERE",
    "Embeddings map text to vectors so that similar meanings are close.",
    "Dynamic batching groups requests that arrive close together in time.",
    "naïve café résumé coöperate",
    "😀😃😄😁😆😅😂🤣",
    LONG,
    "short " * 300,  # far past max_seq_length, repeated subword
    LONG[:900],  # a little past it
    "The end.",
]


@pytest.fixture(scope="module")
def model() -> EmbeddingModel:
    return EmbeddingModel.load(MINILM_NAME)


@pytest.fixture(scope="module")
def reference() -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(resolve_embedding_model(MINILM_NAME), device="cpu")


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_config_follows_the_sentence_transformers_files(
    model: EmbeddingModel, reference: Any
) -> None:
    assert model.dimension == 384 == reference.get_embedding_dimension()
    assert model.max_input_tokens == 256 == reference.max_seq_length
    assert model.pipeline.pooling == "mean" and model.pipeline.normalize


def test_batched_vectors_match_sentence_transformers(model: EmbeddingModel, reference: Any) -> None:
    ours = model.embed(SENTENCES)
    ref = reference.encode(SENTENCES, batch_size=len(SENTENCES), convert_to_numpy=True)
    assert ours.vectors.dtype == np.float32 and ours.vectors.shape == (len(SENTENCES), 384)
    cos = _cosines(ours.vectors, ref)
    assert cos.min() >= 1 - 1e-4, SENTENCES[int(cos.argmin())]
    np.testing.assert_allclose(np.linalg.norm(ours.vectors, axis=1), 1.0, atol=1e-5)


def test_one_at_a_time_matches_and_batching_changes_no_vector(
    model: EmbeddingModel, reference: Any
) -> None:
    batched = model.embed(SENTENCES).vectors
    for i, text in enumerate(SENTENCES):
        alone = model.embed([text]).vectors
        ref = reference.encode([text], convert_to_numpy=True)
        assert _cosines(alone, ref)[0] >= 1 - 1e-4, text
        # Padding to the batch's longest input must not move the vector (float noise only).
        np.testing.assert_allclose(alone[0], batched[i], atol=1e-5, err_msg=text)


def test_long_inputs_are_truncated_like_sentence_transformers(
    model: EmbeddingModel, reference: Any
) -> None:
    counts = model.embed(SENTENCES).num_tokens
    expected = [
        len(reference.tokenizer(s, truncation=True, max_length=256)["input_ids"]) for s in SENTENCES
    ]
    assert counts == expected
    assert counts[SENTENCES.index(LONG)] == 256


def test_token_id_input_is_read_verbatim(model: EmbeddingModel) -> None:
    texts = ["Hello world", LONG]
    full_ids = [model.tokenizer(t)["input_ids"] for t in texts]  # LONG: > 256, ends in [SEP]
    assert len(full_ids[1]) > 256 and full_ids[1][-1] == model.sep_token_id
    from_ids = model.embed(full_ids)
    from_text = model.embed(texts)
    assert from_ids.num_tokens == from_text.num_tokens == [4, 256]
    np.testing.assert_allclose(from_ids.vectors, from_text.vectors, atol=1e-6)
    # Without [SEP] at the end, a long id list keeps its head.
    no_sep = full_ids[1][:-1]
    head = model.embed([no_sep[:256]]).vectors
    np.testing.assert_allclose(model.embed([no_sep]).vectors, head, atol=1e-6)


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ([], "input must not be empty"),
        (["ok", ""], r"input\[1\] is an empty string"),
        ([[101, 102], []], r"input\[1\] is an empty list"),
        ([[101, -1, 102]], r"input\[0\] holds token id -1, outside \[0, 30522\)"),
        ([[101, 30522, 102]], r"input\[0\] holds token id 30522"),
        ([[101, True]], r"input\[0\] holds True"),
        ([[101, 1.5]], r"input\[0\] holds 1.5"),
        (["text", [101, 102]], "input must be all strings or all lists"),
    ],
)
def test_bad_input_names_the_field(model: EmbeddingModel, inputs: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        model.embed(inputs)


def test_unknown_model_names_the_field(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="model: 'no-such-model' is neither"):
        EmbeddingModel.load("no-such-model")
