"""Custom handlers that call other models of the fleet (tests/server/test_server_fleet_client.py)."""

from __future__ import annotations

import asyncio
from typing import Any

from fleetserve.serve.microbatch.proc_fleet import FleetCallError


class Complete:
    """Each instance's prompt completed by `model` through the fleet client."""

    def __init__(self, fleet: Any, model: str) -> None:
        self.fleet, self.model = fleet, model

    async def __call__(self, instances: list[dict[str, Any]]) -> list[dict[str, Any]]:
        async def one(inst: dict[str, Any]) -> dict[str, Any]:
            model = inst.get("model", self.model)
            try:
                body = await self.fleet.complete(
                    model, inst["prompt"], max_tokens=inst.get("max_tokens", 4), temperature=0.0,
                    **inst.get("params", {}),
                )  # fmt: skip
            except FleetCallError as e:
                return {"error": str(e), "status": e.status}
            return {"text": body["choices"][0]["text"], "model": body["model"]}

        return list(await asyncio.gather(*(one(i) for i in instances)))


class StreamComplete:
    """Each instance's prompt streamed by `model` (complete_stream): the text of the first
    `read` chunks (all without it); stopping early closes the stream."""

    def __init__(self, fleet: Any, model: str) -> None:
        self.fleet, self.model = fleet, model

    async def __call__(self, instances: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for inst in instances:
            stream = self.fleet.complete_stream(
                inst.get("model", self.model), inst["prompt"],
                max_tokens=inst.get("max_tokens", 4), temperature=0.0,
                **inst.get("params", {}),
            )  # fmt: skip
            texts: list[str] = []
            try:
                async for chunk in stream:
                    texts.append("".join(c["text"] for c in chunk["choices"]))
                    if len(texts) == inst.get("read"):
                        break
            except FleetCallError as e:
                out.append({"error": str(e), "status": e.status})
                continue
            finally:
                await stream.aclose()
            out.append({"text": "".join(texts), "chunks": len(texts)})
        return out
