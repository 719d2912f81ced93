"""The `custom` handler of `fleetserve bench rag`: embed the question, take the nearest
shipped documents, answer with a chat model, both through the fleet client."""

from __future__ import annotations

import asyncio
from typing import Any

from fleetserve.bench.rag import chat_body, documents, top_k


class RagAnswer:
    def __init__(
        self, fleet: Any, embed_model: str, chat_model: str, max_tokens: int = 8, top_k: int = 2
    ) -> None:
        self.fleet, self.embed_model, self.chat_model = fleet, embed_model, chat_model
        self.max_tokens, self.k = max_tokens, top_k
        self.docs = documents()
        self.vecs: list[list[float]] | None = None

    async def _doc_vectors(self) -> list[list[float]]:
        if self.vecs is None:  # once, on the first call (the fleet is up by then)
            body = await self.fleet.embed(self.embed_model, self.docs)
            self.vecs = [d["embedding"] for d in body["data"]]
        return self.vecs

    async def __call__(self, instances: list[dict[str, Any]]) -> list[dict[str, Any]]:
        vecs = await self._doc_vectors()

        async def one(inst: dict[str, Any]) -> dict[str, Any]:
            q = str(inst["question"])
            vec = await self.fleet.embed(self.embed_model, q)
            ctx = [self.docs[i] for i in top_k(vec["data"][0]["embedding"], vecs, self.k)]
            body = chat_body(self.chat_model, q, ctx, self.max_tokens)
            out = await self.fleet.chat(
                self.chat_model,
                body["messages"],
                max_tokens=self.max_tokens,
                temperature=0.0,
            )
            return {"answer": out["choices"][0]["message"]["content"], "context": ctx}

        return list(await asyncio.gather(*(one(i) for i in instances)))
