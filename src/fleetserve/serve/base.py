"""Routing interface: what a policy sees of a request and of a replica, and its contract."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar


@dataclass(frozen=True)
class RouteRequest:
    """What the router knows of a request when it picks a replica."""

    req_id: str
    prompt_token_ids: tuple[int, ...]
    # Upper bound on the tokens it will generate (max_tokens times n).
    num_new_tokens: int
    priority: int = 0

    @property
    def num_tokens(self) -> int:
        """The work it adds to a replica: prompt tokens to prefill plus tokens to generate."""
        return len(self.prompt_token_ids) + self.num_new_tokens


class ReplicaLoad(Protocol):
    """The load figures of one replica, as the frontend last saw them.

    `ReplicaHandle` is the real one; tests pass plain objects with these attributes.
    """

    @property
    def index(self) -> int: ...

    @property
    def healthy(self) -> bool: ...

    @property
    def num_outstanding_requests(self) -> int: ...

    @property
    def num_outstanding_tokens(self) -> int:
        """Prompt tokens not yet prefilled plus tokens still to generate, over every request
        routed to it and not finished."""
        ...

    @property
    def step_latency_s(self) -> float | None:
        """EWMA of its engine step time; None before its first step."""
        ...


R = TypeVar("R", bound=ReplicaLoad)


def load_key(replica: ReplicaLoad) -> tuple[int, int, int]:
    """Less is less loaded: outstanding tokens, then requests, then the lower index (so
    that every policy breaks ties the same, deterministic way)."""
    return (replica.num_outstanding_tokens, replica.num_outstanding_requests, replica.index)


class RoutingPolicy(abc.ABC):
    """Picks the replica for one request.

    Contract:
    - `choose` is called by the router on the event loop thread, once per request, with a
      non-empty list of candidates in index order: healthy replicas that are not being
      routed around as stragglers. It returns one of them; it must not block or await.
    - It may keep state (a cursor, a prefix map, an RNG) and update it in `choose`: the
      returned replica is the one the request goes to. If submitting then fails (bad
      input, full queue), the router may call `choose` again without the refused replica.
    - It reads the replicas' load through `ReplicaLoad` only and never changes it.
    """

    name: str

    @abc.abstractmethod
    def choose(self, request: RouteRequest, candidates: Sequence[R]) -> R:
        """The replica `request` goes to; one of `candidates`."""
