"""The half of the ModelService surface that a composite model (a cascade, a graph) shares:
it owns no engine, so it has nothing to start, stop or abort (its requests are its
callees' requests, which report, start and abort themselves), and counts only its own
requests in flight."""

from __future__ import annotations


class Composite:
    _in_flight: int = 0

    @property
    def dead_reason(self) -> str | None:
        return None  # the models it calls report their own

    @property
    def crashed(self) -> bool:
        return False

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    async def start(self, timeout_s: float = 600.0) -> None:
        return None

    async def shutdown(self) -> None:
        return None

    def abort_all(self, reason: str) -> None:
        return None  # its requests are its callees' requests: they abort them
