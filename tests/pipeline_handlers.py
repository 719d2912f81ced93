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
                    model, inst["prompt"], max_tokens=inst.get("max_tokens", 4), temperature=0.0
                )
            except FleetCallError as e:
                return {"error": str(e), "status": e.status}
            return {"text": body["choices"][0]["text"], "model": body["model"]}

        return list(await asyncio.gather(*(one(i) for i in instances)))
