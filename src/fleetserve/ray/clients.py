"""The ingress's client of a generate model's deployment: what the local server's
handlers and registry take as they take GenerateService, backed by a Serve deployment
handle (embed and custom models: batch_clients.py).

A generate request goes through the same steps as on the local server, in the ingress:
tokenize and validate (400s), its class's queue (serve/admission/sla.py: ordered by class, then the
request's priority, then deadline; 503 when the class is full or its max_queue_time_s
passes), then dispatch while the model has room: in-flight requests below its replicas
times `max_ongoing_requests` (one replica's worth when none is known yet, so that the
first request reaches Serve and wakes a scaled-to-zero deployment). Serve's router (ours,
router.py) then picks the replica, and the engine's priority scheduler orders what it holds.

Each sent engine request is a `FleetStream` (serve/request_state.py) over its calls: when
the replica running it is lost (its actor, node or engine process died, Serve stopped it;
streams.py), the client is its `Resubmitter` and calls the deployment again with
`resume=` the last output its reader got and `avoid=` the replicas the request was lost
on, which the router never picks for it; the new replica prefills prompt + tokens so far
and the reader's stream goes on. The request keeps its seat in the ingress meanwhile.
A class with `hedge_after_s` hedges as on the local server (serve/resilience/hedging.py): the copy is
one more call, whose `avoid` names the replica the first call went to.

A model with `pools` has one deployment per pool (pools.py): each call goes to the spot
deployment while one of its replicas has room, else to the deployment with the least
loaded replica (a class with `capacity: spot`: spot only); a lost request resumes on any
pool's replica, so a request lost with a spot node goes on on on-demand.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from fleetserve.config import model_root
from fleetserve.core.lora_request import LoRARequest
from fleetserve.core.sampling_params import SamplingParams
from fleetserve.engine.async_engine import EngineDeadError, ReplicaGoneError
from fleetserve.engine.prompt_rules import PromptRules, PromptType
from fleetserve.lora.metrics import LoRAMetrics
from fleetserve.metrics import ModelMetrics
from fleetserve.outputs import OutputFold, RequestOutput
from fleetserve.ray import router_state
from fleetserve.ray.pool_deployments import PoolChoice, PoolRoute
from fleetserve.ray.router_state import num_known_replicas
from fleetserve.ray.streams import RayStream, RequestObserver
from fleetserve.serve.admission.admit import Admission
from fleetserve.serve.admission.sla import Entry, ServiceClass, engine_priority
from fleetserve.serve.config.fleet_config import FleetConfig, ModelEntry
from fleetserve.serve.contracts import ReplicaStreamLike
from fleetserve.serve.request_state import FleetStream, RequestState
from fleetserve.serve.resilience.hedging import hedge_for
from fleetserve.serve.resilience.migration import migration_reason
from fleetserve.serve.services.adapters import AdapterTable
from fleetserve.tokenizer import Tokenizer


@dataclass
class _Item:
    request_id: str
    prompt: dict[str, Any]
    params: SamplingParams
    num_prompt_tokens: int
    num_new_tokens: int
    # The LoRA adapter it runs with (the fleet file's `adapters:`; None: the base model).
    lora: LoRARequest | None = None


log = logging.getLogger("fleetserve.ray")

# How often a request that lost its replica looks for Serve to list another one.
_REPLICA_POLL_S = 0.2
# The replica index a FleetStream is given for a call: Serve's router places a call
# after it is made, so the client learns the replica later (RayStream.replica_index).
_UNPLACED = -1


_Placed = tuple[str, int]  # (deployment, replica index)


@dataclass
class _Call:
    """What sending an engine request (again) needs: FleetStream's `context`."""

    item: _Item
    service_class: ServiceClass
    priority: int  # the engine's (class and request folded)
    lost_on: set[tuple[str, int]] = field(default_factory=set)  # (deployment, replica)

    def avoid(self, deployment: str, also: frozenset[_Placed] = frozenset()) -> frozenset[int]:
        """The replicas of `deployment` the call must not go to: those the request was lost
        on, and `also` (a hedge's copy: the first call's)."""
        return frozenset(i for d, i in self.lost_on | also if d == deployment)


@dataclass
class _Pending:
    """A queued request (a serve/admission/admit.py Waiter); `future` resolves when its turn
    comes to be sent (its seats are then reserved)."""

    items: list[_Item]
    future: asyncio.Future[None]
    arrival: float


class RayGenerateClient:
    kind = "generate"

    def __init__(
        self,
        entry: ModelEntry,
        fleet: FleetConfig,
        handle: DeploymentHandle | None,
        max_ongoing_requests: int,
        metrics: ModelMetrics | None = None,
        pools: Mapping[str, DeploymentHandle] | None = None,
    ) -> None:
        """`handle`: the model's deployment; for a model with `pools`, None, and `pools`
        holds each pool's deployment by pool name."""
        self.name = entry.name
        self.tool_parser = entry.tool_parser
        self._handles: dict[str, DeploymentHandle] = {}  # deployment name -> handle
        routes: list[PoolRoute] = []
        capacity_of = {p.name: p.capacity for p in entry.pools or []}
        for pool, h in (pools or {}).items():
            routes.append(PoolRoute(pool, capacity_of[pool], h.deployment_name))
            self._handles[h.deployment_name] = h
        if handle is not None:
            routes.append(PoolRoute("default", "on_demand", handle.deployment_name))
            self._handles[handle.deployment_name] = handle
        if len(routes) != (len(pools or {}) or 1):
            raise ValueError("give a model's handle or its pools' handles, not both")
        self.deployment_name = routes[0].deployment
        self.metrics = metrics
        # Per-adapter series (lora_name): requests and tokens counted here, the replicas'
        # loads and evictions from their routing stats (ingress.py's collector).
        self.lora_metrics = LoRAMetrics(metrics) if metrics is not None else None
        self.max_ongoing_requests = max_ongoing_requests
        args = entry.engine_args()
        self.config, source = args.resolve()
        self.tokenizer = Tokenizer.from_source(source)
        self._rules = PromptRules(self.tokenizer, self.config)
        # The model's adapters (the fleet file's `adapters:`, and those loaded through
        # /v1/load_lora_adapter at this ingress); a call passes its request's adapter to the
        # replica's engine, which loads it from its path on first use.
        self.adapters = AdapterTable(self.name, self.config, args)
        self.pools = PoolChoice(
            routes, self.config.scheduler.max_num_seqs, fleet.spot_only_classes()
        )
        self.admission: Admission[_Pending] = Admission(
            self.name,
            fleet.service_classes(),
            fleet.default_class_name,
            metrics,
            priority_ordered=self.config.scheduler.policy == "priority",
        )
        self.queue = self.admission.queue  # read by the handlers and the dashboard
        self.resilience = entry.resilience
        self.num_in_flight_streams = 0
        self._unstarted: Counter[str] = Counter()  # sent, no output yet (RequestObserver)
        self._started = False
        self._closing = False

    # ------------------------------------------------------------- ModelService
    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    @property
    def is_ready(self) -> bool:
        return self._started

    @property
    def dead_reason(self) -> str | None:
        return None  # Serve replaces dead replicas; their requests move to others

    @property
    def crashed(self) -> bool:
        return False

    @property
    def num_in_flight(self) -> int:
        return len(self.queue) + self.num_in_flight_streams

    def card(self) -> dict[str, Any]:
        return {
            # What vLLM gives (clients load a tokenizer from it): the model's folder, or
            # for a single .gguf file the served name; the file itself is model_path.
            "root": model_root(self.config.model_path, self.name),
            "model_path": self.config.model_path,
            "max_model_len": self.max_model_len,
            "replicas": self._num_known_replicas(),
        }

    def waiting_by_class(self) -> dict[str, int]:
        return {name: self.queue.num_waiting(name) for name in self.queue.classes}

    async def start(self, timeout_s: float = 600.0) -> None:
        loop = asyncio.get_running_loop()

        def replicas_changed() -> None:
            # More replicas, more room: queued requests need not wait for one to finish.
            # (Serve may run the handle's router on a thread of its own.)
            loop.call_soon_threadsafe(self._dispatch)

        for deployment, handle in self._handles.items():
            router_state.LISTENERS.setdefault(deployment, []).append(replicas_changed)
            if len(self._handles) > 1:
                # Makes the handle's router now (Serve makes it on the first call): the
                # choice between pools reads every pool's replicas.
                handle.options(stream=True)
        self._started = True

    async def shutdown(self) -> None:
        self._closing = True
        self.admission.close()
        self.abort_all("the server is shutting down")

    def abort_all(self, reason: str) -> None:
        self.admission.fail_all(lambda: EngineDeadError(reason))

    # ------------------------------------------------------------- admission
    @property
    def capacity(self) -> int:
        """Requests the model's replicas take at once (one replica's worth while Serve
        has none or the router has not seen them yet)."""
        return max(self._num_known_replicas(), 1) * self.max_ongoing_requests

    def _num_known_replicas(self) -> int:
        return sum(num_known_replicas(d) or 0 for d in self._handles)

    async def admit(
        self,
        request_id: str,
        prompts: list[PromptType],
        params_for: Callable[[], SamplingParams],
        class_name: str | None = None,
        priority: int = 0,
        *,
        lora_name: str | None = None,
    ) -> list[FleetStream]:
        """As GenerateService.admit: validate, queue by class, return the streams once
        dispatched. Cancelling the wait takes the request out of the queue.

        The request is sent from its own task, once its turn comes: a Serve handle call
        belongs to the HTTP request whose context makes it (its request id, its
        cancellation), so it must not be made from another request's task."""
        cls = self.admission.resolve(class_name, priority)
        lora = None if lora_name is None else self.adapters.get(lora_name)
        items = [self._prepare(f"{request_id}-{i}", p, params_for()) for i, p in enumerate(prompts)]
        for item in items:
            item.lora = lora
        pending = _Pending(items, asyncio.get_running_loop().create_future(), time.monotonic())
        entry = self.admission.push(pending, cls, priority)
        self._dispatch()
        try:
            await pending.future
        except asyncio.CancelledError:
            if not self.queue.remove(entry) and pending.future.done():
                self._release(len(items))  # its turn came, but it left before sending
            raise
        return self._send(entry)

    def _prepare(self, request_id: str, prompt: PromptType, params: SamplingParams) -> _Item:
        text, ids = self._rules.tokenize_prompt(prompt)
        self._rules.validate(ids, params)
        # The KV capacity is the replica's to check; the model length bounds it here.
        room = self.max_model_len - len(ids)
        if room < 1:
            raise ValueError(f"the prompt's {len(ids)} tokens leave no room to generate")
        routed: dict[str, Any] = {"prompt_token_ids": ids}
        if text is not None:
            routed["prompt"] = text
        num_new = (params.max_tokens or room) * params.n
        return _Item(request_id, routed, params, len(ids), num_new)

    def _dispatch(self) -> None:
        """Gives queued requests their turn, most important first, while there is room."""
        while (entry := self.queue.peek()) is not None:
            if self.num_in_flight_streams > 0 and self.num_in_flight_streams >= self.capacity:
                return
            self.queue.pop()
            self.num_in_flight_streams += len(entry.payload.items)
            entry.payload.future.set_result(None)

    def _release(self, num_streams: int) -> None:
        self.num_in_flight_streams -= num_streams
        self._dispatch()

    def _send(self, entry: Entry[_Pending]) -> list[FleetStream]:
        pending = entry.payload
        cls = entry.service_class
        streams: list[FleetStream] = []
        try:
            for item in pending.items:
                call = _Call(item, cls, engine_priority(cls, entry.priority))
                inner = self._call(call)
                lora = None
                if item.lora is not None and self.lora_metrics is not None:
                    lora = (self.lora_metrics, item.lora.lora_name)
                    self.lora_metrics.add_request(item.lora.lora_name, item.num_prompt_tokens)
                observer = RequestObserver(
                    self.metrics, cls.name, pending.arrival, self._unstarted, self._release_one,
                    lora,
                )  # fmt: skip
                state = RequestState(
                    item.request_id,
                    item.params.n,
                    cls.name,
                    call.priority,
                    pending.arrival,
                    OutputFold(item.request_id, item.params.n),
                    _UNPLACED,
                    queue_deadline=None if entry.deadline == float("inf") else entry.deadline,
                )
                stream = FleetStream(
                    state,
                    inner,
                    self,
                    observer=observer,
                    migration_limit=self.resilience.migration_limit,
                    hedge=hedge_for(cls.hedge_after_s, self.hedge, self.metrics),
                    context=call,
                )
                streams.append(stream)
        except BaseException:
            for s in streams:
                s.close()  # gives its seat back
            self._release(len(pending.items) - len(streams))
            raise
        return streams

    def _call(
        self,
        call: _Call,
        resume: RequestOutput | None = None,
        also: frozenset[_Placed] = frozenset(),
    ) -> RayStream:
        """Calls the deployment for `call` (going on from `resume`), never on a replica it
        was lost on or in `also`."""
        item = call.item
        cls = call.service_class.name
        deployment = self.pools.pick(cls, lambda d: call.avoid(d, also)) or self.pools.fallback(cls)
        avoid = call.avoid(deployment, also)
        caller = self._handles[deployment].options(stream=True)
        num_done = 0 if resume is None else sum(len(c.token_ids) for c in resume.outputs)
        gen = caller.generate.remote(
            request_id=item.request_id,
            prompt=item.prompt,
            params=item.params,
            priority=call.priority,
            num_prompt_tokens=item.num_prompt_tokens,
            num_new_tokens=max(item.num_new_tokens - num_done, 0),
            level=call.service_class.priority,
            resume=resume,
            avoid=sorted(avoid),
            lora=item.lora,
        )
        assert isinstance(gen, DeploymentResponseGenerator)  # stream=True
        return RayStream(
            item.request_id,
            item.params.n,
            gen,
            lambda: self._placement(item, deployment, avoid),
            deployment,
        )

    def _placement(self, item: _Item, deployment: str, avoid: frozenset[int]) -> int | None:
        """Where the router sent the call. The router keeps an engine request's newest
        call only, and this call never goes to a replica in `avoid`: such an answer is an
        earlier call's (this one is not routed yet)."""
        router = router_state.ROUTERS.get(deployment)
        index = None if router is None else router.placement(item.request_id)
        return None if index in avoid else index

    def _release_one(self) -> None:
        self._release(1)

    # ------------------------------------------------------------- migration
    async def resubmit(
        self, stream: FleetStream, exclude: set[int]
    ) -> tuple[ReplicaStreamLike, int]:
        """Resubmitter (serve/resilience/migration.py): calls the deployment again for `stream`'s
        request, going on from the output its reader got last, never on a replica it was
        lost on; first waits up to migration_wait_s for Serve to list a replica it may go
        to (EngineDeadError if none). `exclude` holds only _UNPLACED: which replica each
        call went to is the router's to say (RayStream.replica_index)."""
        call: _Call = stream.context
        old = stream.inner
        if isinstance(old, RayStream) and old.replica_index is not None:
            call.lost_on.add((old.deployment, old.replica_index))
        await self._wait_for_replica(call)
        inner = self._call(call, resume=stream.state.resume_from())
        return inner, _UNPLACED

    async def hedge(self, stream: FleetStream, exclude: set[int]) -> tuple[ReplicaStreamLike, int]:
        """CopyMaker (serve/resilience/hedging.py): calls the deployment again for `stream`'s request,
        from its start, never on the replica its first call went to (the copy's `avoid`:
        the two calls never meet in one engine, where they would share a request id).
        EngineDeadError at once when that call is not routed yet (it waits in Serve for a
        replica with room, as a copy would) or no other replica is listed. `exclude` holds
        only _UNPLACED (see resubmit)."""
        call: _Call = stream.context
        first = stream.inner
        index = first.replica_index if isinstance(first, RayStream) else None
        if index is None or not isinstance(first, RayStream):
            raise EngineDeadError("the request's call is not routed yet: no copy")
        also = frozenset({(first.deployment, index)})
        if self.pools.pick(call.service_class.name, lambda d: call.avoid(d, also)) is None:
            raise EngineDeadError(f"no other replica of {self.name!r} for a hedged copy")
        # The copy takes a seat of the in-flight budget for as long as both calls run:
        # the race ends when one of them ends (the loser is closed at once).
        if self.num_in_flight_streams >= self.capacity:
            raise EngineDeadError(f"no room in {self.name!r}'s in-flight budget for a copy")
        copy = self._call(call, also=also)
        self.num_in_flight_streams += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._release(1)

        first.on_end.append(release)
        copy.on_end.append(release)
        return copy, _UNPLACED

    async def _wait_for_replica(self, call: _Call) -> None:
        """Returns once Serve's routers list a replica the request may go to, one it was
        not lost on (at once when they do; Serve then places the call, as any call)."""
        wait_s = self.resilience.migration_wait_s
        deadline = time.monotonic() + wait_s
        while True:
            if self._closing:
                raise EngineDeadError("the server is shutting down")
            if self.pools.pick(call.service_class.name, call.avoid) is not None:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineDeadError(
                    f"no replica of {self.name!r} could take the request over "
                    f"(waited {wait_s:g} s, migration_wait_s)"
                )
            await asyncio.sleep(min(left, _REPLICA_POLL_S))

    def on_migrated(self, stream: FleetStream, error: ReplicaGoneError) -> None:
        old = stream.inner
        index = old.replica_index if isinstance(old, RayStream) else None
        log.info("%s: request %s moves off replica %s (%s)", self.name, stream.request_id,
                 index, error)  # fmt: skip
        if self.metrics is not None:
            self.metrics.add_migration(migration_reason(error))
