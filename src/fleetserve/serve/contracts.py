"""The serve layer's contracts: what a policy sees of a request and of a replica, the
routing policy, and the replica itself (one engine client, whatever runs it)."""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from fleetserve.core.lora_request import LoRARequest
from fleetserve.core.sampling_params import SamplingParams
from fleetserve.engine.stats import EngineStats
from fleetserve.outputs import RequestOutput

if TYPE_CHECKING:
    from fleetserve.serve.request_state import RequestState


@dataclass(frozen=True)
class RouteRequest:
    """What the router knows of a request when it picks a replica."""

    req_id: str
    prompt_token_ids: tuple[int, ...]
    # Upper bound on the tokens it will generate (max_tokens times n).
    num_new_tokens: int
    priority: int = 0
    # The LoRA adapter it runs with (None: the base model): routing prefers replicas
    # that hold it (serve/routing/adapters.py).
    lora_name: str | None = None

    @property
    def num_tokens(self) -> int:
        """The work it adds to a replica: prompt tokens to prefill plus tokens to generate."""
        return len(self.prompt_token_ids) + self.num_new_tokens


class ReplicaLoad(Protocol):
    """The load figures of one replica, as the frontend last saw them.

    Every `Replica` is one; router tests pass plain objects with these attributes.
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


class ReplicaStreamLike(Protocol):
    """One request's deltas from one replica (one call: the engine client's DeltaStream,
    a Ray call's RayStream), in order; a slow reader gets the merged delta of what it
    missed. `close()` aborts it if it has not finished."""

    request_id: str
    n: int

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    async def __anext__(self) -> RequestOutput: ...

    def close(self) -> None: ...


class StreamObserver(Protocol):
    """Told of a request's deltas, with its state (the fold of what its reader got so
    far, replicas, migrations: serve/request_state.py); its service measures latencies
    by class with it."""

    def on_output(self, delta: RequestOutput, state: RequestState) -> None: ...

    def on_end(self) -> None:
        """The request ended (finished, failed or closed); called once."""
        ...


class Replica(ReplicaLoad, Protocol):
    """One engine replica of a model, whatever runs it: a local engine-core process
    (`LocalReplica`), and later a Ray actor, another fleetserve server over HTTP, a batch
    worker. Routing, class queues and drain are written once against this contract.

    All methods are called on the API process's event loop thread. `submit` never blocks:
    it validates against the replica's own limits (KV capacity), raising ValueError for
    bad input or EngineDeadError / EngineNotReadyError when it cannot serve, and returns
    the request's stream. `healthy` is false while loading, once dead, and from the start
    of `drain`: the router sends it nothing then.
    """

    # Called with the replica when one of its requests ends (its seats are free again),
    # after each of its engine steps' stats, and with (replica, notice) when its engine
    # says it will be taken away (set by its service).
    on_finish: Callable[[Any], None] | None
    on_stats: Callable[[Any], None] | None
    on_notice: Callable[[Any, Any], None] | None
    # Set once drain() or stop() began: it takes no new requests.
    draining: bool
    # Its pool (serve/replicas/pool_plan.py) and the pool's capacity: "spot" or "on_demand".
    pool: str
    capacity: str

    @property
    def dead_reason(self) -> str | None:
        """Why it can serve no more (its process died, it was stopped); None while alive."""
        ...

    @property
    def crashed(self) -> bool:
        """Its engine exited without being asked to."""
        ...

    @property
    def kv_capacity_tokens(self) -> int | None:
        """Tokens its KV cache holds (what one request may use at most); None until loaded."""
        ...

    @property
    def stats(self) -> EngineStats | None:
        """Its engine's latest stats (None: none reported yet)."""
        ...

    @property
    def num_routed(self) -> int: ...

    @property
    def lora_names(self) -> frozenset[str]:
        """The LoRA adapters it holds in memory, or is loading for requests sent to it
        (what adapter-aware routing prefers)."""
        ...

    @property
    def pid(self) -> int | None:
        """Its engine's process id where it runs on this machine (None elsewhere)."""
        ...

    def hung_for(self, now: float) -> float:
        """Seconds it has held work without an engine step (0 when idle or progressing)."""
        ...

    @property
    def queue_depth(self) -> int:
        """Requests waiting in its engine's scheduler at its last step."""
        ...

    @property
    def prefix_cache_hit_rate(self) -> float: ...

    async def start(self, timeout_s: float = 600.0) -> None:
        """Loads the model; raises if it fails or takes longer than `timeout_s`."""
        ...

    def submit(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams,
        priority: int,
        num_prompt_tokens: int,
        level: int = 0,
        resume: RequestOutput | None = None,
        lora_request: LoRARequest | None = None,
    ) -> ReplicaStreamLike:
        """`resume`: the request's whole output so far (folded) as its reader got it on a
        lost replica; the request goes on from it here (request migration,
        serve/resilience/migration.py).
        `lora_request`: the LoRA adapter it runs with (None: the base model)."""
        ...

    def abort(self, request_id: str) -> None: ...

    def has_room(self, level: int, num_seqs: int) -> bool:
        """Whether a request of `num_seqs` sequences at class level `level` may be sent now."""
        ...

    async def drain(self, timeout_s: float, migrate: bool = True) -> bool:
        """Stops taking requests and lets those it holds finish within `timeout_s`; with
        `migrate`, the ones that would not are handed over at once and the rest at the
        end (ReplicaGoneError: their service resumes them elsewhere). True if they all
        finished here."""
        ...

    def abort_all(self, reason: str) -> None:
        """Ends every request it holds with EngineDeadError(reason) (no migration)."""
        ...

    def evict_all(self, reason: str) -> None:
        """Hands every request it holds over to other replicas (ReplicaGoneError)."""
        ...

    async def stop(self, kill: bool = False) -> None:
        """Hands what it still holds over (ReplicaGoneError) and releases its process;
        `kill` kills the process first (a hung engine cannot be asked to stop)."""
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
