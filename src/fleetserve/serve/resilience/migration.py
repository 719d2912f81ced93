"""Request migration: a request's move to another replica when the one running it is lost.

Each engine request's FleetStream (serve/request_state.py) keeps the request's state:
its prepared prompt (its `context`) and the fold of every delta its reader got (the
prompt, every token and its text so far). When the replica's stream ends with
`ReplicaGoneError` (the engine process died, the replica is being drained for a spot
notice or a scale-down, or it hung), the stream calls `migrate`, which asks its service
for a new replica and resubmits the request there with that fold as `resume`: the new
engine prefills prompt + tokens so far (cheap where its prefix cache has the prompt) and
samples on from the next position, and its deltas continue the old ones. The reader sees
one stream: no token is repeated or dropped, `usage` counts the prompt once, and greedy
or seeded streams equal an undisturbed run (sampling is seeded by seed and position).

Tokens the old replica produced that the reader had not taken yet are generated again;
for an unseeded sampled request they may then differ, which the reader cannot tell.

With a `hedge` (serve/resilience/hedging.py), a request with no first output by its
`after_s` gets a copy on another replica; the first of the two to produce an output wins
and the other is aborted, so the reader (and `usage`) sees one of them only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from fleetserve.engine.async_engine import (
    EngineDeadError,
    ReplicaGoneError,
)
from fleetserve.engine.delta_stream import ReplicaRefusedError
from fleetserve.serve.contracts import ReplicaStreamLike

if TYPE_CHECKING:
    from fleetserve.serve.request_state import FleetStream


def migration_reason(error: ReplicaGoneError) -> str:
    """The `reason` label of fleetserve:request_migrations_total for a lost replica."""
    text = str(error)
    for word, reason in (("drain", "drained"), ("stop", "stopped"), ("hung", "hung")):
        if word in text:
            return reason
    return "died"


# Refusals (ReplicaRefusedError) a request may meet on its way; past them they count as
# migrations (a loop between draining replicas ends).
MAX_REFUSALS = 8


class MigrationLimitError(EngineDeadError):
    """The request lost its replica more times than its `migration_limit` allows."""


class Resubmitter(Protocol):
    """The service side of migration (serve/resilience/resubmit.py, ray/clients.py)."""

    async def resubmit(
        self, stream: FleetStream, exclude: set[int]
    ) -> tuple[ReplicaStreamLike, int]:
        """The request on a new replica (not one of `exclude`), going on from
        `stream.state.resume_from()`; raises EngineDeadError when no replica can take it."""
        ...

    def on_migrated(self, stream: FleetStream, error: ReplicaGoneError) -> None: ...


async def migrate(stream: FleetStream, error: ReplicaGoneError) -> None:
    """Moves `stream`'s request, whose replica was lost with `error`, to another replica
    (its old call is closed already); MigrationLimitError past its migration_limit. A call
    refused before it started (a draining replica) goes elsewhere without using up a move,
    up to MAX_REFUSALS times."""
    state = stream.state
    if isinstance(error, ReplicaRefusedError) and state.refusals < MAX_REFUSALS:
        state.refusals += 1
    else:
        if state.migrations >= stream.migration_limit:
            raise MigrationLimitError(
                f"the request lost its replica {state.migrations + 1} times, more than its "
                f"migration_limit of {stream.migration_limit}; last: {error}"
            ) from None
        state.migrations += 1
        stream.service.on_migrated(stream, error)
    stream.inner, index = await stream.service.resubmit(stream, exclude={state.replica_index})
    state.moved_to(index)
