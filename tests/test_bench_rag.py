"""`fleetserve bench rag`'s harness: the shipped documents, the retrieval, and that the
handler sends the callee the same bodies the by-hand side sends (no server: a recording
fleet stands in for the fleet client; the served path is the benchmark's own check)."""

from __future__ import annotations

import asyncio
from typing import Any

from fleetserve.bench.rag import chat_body, documents, questions, top_k
from fleetserve.bench.rag_handler import RagAnswer
from fleetserve.entrypoints.cli import build_parser


def test_the_shipped_set() -> None:
    assert 20 <= len(documents()) <= 50 and len(questions()) >= 4


def test_top_k_orders_by_score_then_index() -> None:
    docs = [[1.0, 0.0], [0.0, 1.0], [0.6, 0.8], [0.0, 1.0]]
    assert top_k([0.0, 1.0], docs, 2) == [1, 3]
    assert top_k([1.0, 0.0], docs, 3) == [0, 2, 1]


class Recorder:
    """Answers embed with one-hot vectors (document i -> axis i, the question -> axis 3)."""

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, []  # type: ignore[var-annotated]

    async def embed(self, model: str, inputs: Any) -> dict[str, Any]:
        self.calls.append(("embed", model, inputs))
        texts = inputs if isinstance(inputs, list) else [inputs]
        hot = [3] if isinstance(inputs, str) else list(range(len(texts)))
        vecs = [[1.0 if j == h else 0.0 for j in range(self.n)] for h in hot]
        return {"data": [{"embedding": v} for v in vecs]}

    async def chat(self, model: str, messages: list[dict[str, str]], **params: Any) -> Any:
        self.calls.append(("chat", model, messages, params))
        return {"choices": [{"message": {"content": "ok"}}]}


def test_the_handler_does_what_the_by_hand_side_does() -> None:
    docs = documents()
    fleet = Recorder(len(docs))
    handler = RagAnswer(fleet, "minilm", "chat", max_tokens=5, top_k=1)
    out = asyncio.run(handler([{"question": "Q?"}]))
    assert out == [{"answer": "ok", "context": [docs[3]]}]
    assert fleet.calls[0] == ("embed", "minilm", docs)  # documents once, up front
    assert fleet.calls[1] == ("embed", "minilm", "Q?")
    want = chat_body("chat", "Q?", [docs[3]], 5)
    _, model, messages, params = fleet.calls[2]
    assert model == "chat" and messages == want["messages"]
    assert params == {"max_tokens": 5, "temperature": 0.0}
    asyncio.run(handler([{"question": "Q?"}]))
    assert [c[0] for c in fleet.calls] == ["embed", "embed", "chat", "embed", "chat"]


def test_the_cli_knows_the_subcommand() -> None:
    argv = ["bench", "rag", "--model", "m", "--top-k", "3"]
    args = build_parser(argv).parse_args(argv)
    assert args.model == "m" and args.top_k == 3 and args.requests == 24
