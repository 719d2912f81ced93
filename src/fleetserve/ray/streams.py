"""One generate call to a Serve replica as the ingress reads it (`RayStream`), and the
observer that measures and seats a request across all its calls (`RequestObserver`).

A call that ends because its replica is lost ends with ReplicaGoneError: the replica's
actor or its node died or is unreachable (Ray's RayActorError, ActorDiedError,
ActorUnavailableError, NodeDiedError), or the replica says so itself (its engine process
died, Serve is stopping it: RemoteError kind "gone"). The request's FleetStream
(serve/request_state.py) answers that by resuming it on another replica (clients.py). Any
other failure ends it with the error the handlers map to HTTP, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable

from ray.exceptions import NodeDiedError, RayActorError, RayTaskError
from ray.serve.handle import DeploymentResponseGenerator

from fleetserve.engine.async_engine import EngineDeadError, ReplicaGoneError
from fleetserve.lora.metrics import LoRAMetrics
from fleetserve.metrics import ModelMetrics
from fleetserve.outputs import RequestOutput
from fleetserve.ray.wire import RemoteError
from fleetserve.serve.admission.admit import ClassObserver
from fleetserve.serve.request_state import RequestState


def replica_lost(e: BaseException) -> bool:
    """Whether a call's failure means its replica is gone (another may take the request)
    rather than a fault of the request."""
    if isinstance(e, (RayActorError, NodeDiedError)):
        return True
    # Ray wraps an actor's death in a RayTaskError when it surfaces through an object ref.
    return isinstance(e, RayTaskError) and isinstance(getattr(e, "cause", None), RayActorError)


def short(e: BaseException) -> str:
    return str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__


class RayStream:
    """One call's deltas (`ReplicaStreamLike`) from a replica of `deployment`, as the
    replica yields them.
    `placement` tells which replica Serve's router sent the call to (the router's index;
    None before it is routed)."""

    def __init__(
        self,
        request_id: str,
        n: int,
        gen: DeploymentResponseGenerator,
        placement: Callable[[], int | None],
        deployment: str = "",
    ) -> None:
        self.request_id, self.n, self._gen = request_id, n, gen
        self.deployment = deployment
        self._placement = placement
        self._index: int | None = None
        self._done = False
        self.lost = False  # ended by ReplicaGoneError: the request may go on elsewhere
        self.on_end: list[Callable[[], None]] = []  # each called once, when the call ends

    @property
    def replica_index(self) -> int | None:
        """The replica this call went to. The router remembers only an engine request's
        newest call, so the answer is kept from the first time it is known and fixed when
        the call ends (before the request is sent anywhere else)."""
        if self._index is None:
            self._index = self._placement()
        return self._index

    def __aiter__(self) -> RayStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._gen.__anext__()
        except StopAsyncIteration:
            self._end()
            raise
        except asyncio.CancelledError:
            self.close()
            raise
        except Exception as e:  # noqa: BLE001 -- the replica (or its node) is gone
            self.close()
            if replica_lost(e):
                self.lost = True
                raise ReplicaGoneError(
                    f"the replica serving the request was lost: {short(e)}"
                ) from e
            raise EngineDeadError(f"the replica serving the request failed: {short(e)}") from e
        if isinstance(item, RemoteError):
            self.close()
            error = item.exception(batch=False)
            self.lost = isinstance(error, ReplicaGoneError)
            raise error
        if item.finished:
            self._end()
        return item

    def _end(self) -> None:
        if not self._done:
            self._done = True
            _ = self.replica_index  # fixed now (see replica_index)
            for callback in self.on_end:
                callback()

    def close(self) -> None:
        """Aborts the request in its replica if it has not finished."""
        if not self._done:
            # Cancelling a call whose actor is gone is a no-op (or raises): either way done.
            with contextlib.suppress(Exception):
                self._gen.cancel()
        self._end()


class RequestObserver(ClassObserver):
    """A request's latencies by class (ClassObserver), across every replica it ran on;
    also what a local engine would count itself (tokens, finish reasons: the replicas'
    engines report no metrics to the ingress): finish reasons as deltas end choices, tokens
    once, from its state's fold when it finishes. `release` gives its seat in the ingress
    back when it ends."""

    def __init__(
        self,
        metrics: ModelMetrics | None,
        class_name: str,
        arrival: float,
        unstarted: Counter[str],
        release: Callable[[], None],
        lora: tuple[LoRAMetrics, str] | None = None,
    ) -> None:
        super().__init__(metrics, class_name, arrival, unstarted)
        self.release = release
        self.lora = lora  # the per-adapter series and the request's adapter

    def on_output(self, delta: RequestOutput, state: RequestState) -> None:
        super().on_output(delta, state)
        if self.metrics is None:
            return
        self.metrics.observe_finished(delta)
        if delta.finished:
            self.metrics.add_prompt_tokens(len(state.fold.prompt_token_ids))
            self.metrics.add_generation_tokens(state.fold.num_generated)
            if self.lora is not None:
                self.lora[0].add_generation_tokens(self.lora[1], state.fold.num_generated)

    def on_end(self) -> None:
        super().on_end()
        self.release()
