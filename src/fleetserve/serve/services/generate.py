"""GenerateService: one generate model of the fleet, behind its name.

    admit() -> tokenize + validate (400s) -> class queue (503 when full) -> dispatch when a
    replica has room for the class -> Router picks among those -> Replica.submit

A request waits in its class's queue (serve/admission/sla.py) until some live replica has room
for it at its class's level: the replica holds fewer than a batch (`max_num_seqs`) of
sequences of that class or more important ones. Less important work never blocks more
important work, since the engine's priority scheduler preempts it; so a flood of `batch`
requests fills the queue and the batch, and an `interactive` request still goes to the
engine at once and takes a batch request's seat on the next step. A request still queued
past its class's `max_queue_time_s` is shed (503) before it costs any compute.

Once sent, each engine request is a `FleetStream` over its `RequestState`
(serve/request_state.py): the service keeps its prompt and the fold of the deltas its
reader got, and when its replica is lost (died,
drained, hung, stopped) its RouterResubmitter (serve/resilience/resubmit.py) resumes it on another
one. The model's gauges pool its replicas' stats (serve/telemetry/pooled_stats.py). Its Supervisor (serve/replicas/supervisor.py)
removes dead and hung replicas and drains those given a preemption notice; its
PoolController (serve/replicas/pool_plan.py, over serve/replicas/provision.py) starts replicas to keep the
pools at their targets, falling back to on-demand when spot is short.

The service owns its queue, its ReplicaSet and its Router; everything runs on the API
process's event loop thread.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from fleetserve.config import model_root
from fleetserve.core.sampling_params import SamplingParams
from fleetserve.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineNotReadyError,
)
from fleetserve.engine.prompt_rules import PromptRules, PromptType
from fleetserve.metrics import ModelMetrics
from fleetserve.outputs import OutputFold, RequestOutput
from fleetserve.serve.admission.admit import Admission, ClassObserver, Pending, PreparedPrompt
from fleetserve.serve.admission.replica_wait import NoReplicaWait
from fleetserve.serve.admission.sla import Entry, ServiceClass, engine_priority, oversubscription
from fleetserve.serve.config.fleet_config import (
    ModelEntry,
    PoolConfig,
)
from fleetserve.serve.contracts import Replica, RouteRequest
from fleetserve.serve.remote.targets import RemoteTargets
from fleetserve.serve.replicas.local import LocalReplica
from fleetserve.serve.replicas.pool_plan import PoolController, prefer_spot
from fleetserve.serve.replicas.provision import LocalProvisioner
from fleetserve.serve.replicas.replica_set import ReplicaSet
from fleetserve.serve.replicas.supervisor import SUPERVISE_INTERVAL_S, Supervisor
from fleetserve.serve.request_state import FleetStream, RequestState
from fleetserve.serve.resilience.hedging import hedge_for
from fleetserve.serve.resilience.resubmit import Narrow, RouterResubmitter, SentRequest
from fleetserve.serve.routing.policies import make_policy
from fleetserve.serve.routing.router import NoHealthyReplicaError, Router
from fleetserve.serve.services.adapters import AdapterTable
from fleetserve.serve.telemetry.pooled_stats import publish_pooled_stats
from fleetserve.tokenizer import Tokenizer

# The engines' own bound on unstarted requests; the class queues bound them first.
_ENGINE_MAX_WAITING = 1 << 20

log = logging.getLogger("fleetserve.serve")


class GenerateService:
    kind = "generate"

    def __init__(
        self,
        entry: ModelEntry,
        classes: Mapping[str, ServiceClass],
        default_class: str,
        *,
        spot_only_classes: frozenset[str] = frozenset(),
        metrics: ModelMetrics | None = None,
        capacity_check: Callable[[PoolConfig], bool] | None = None,
        imbalance_tokens: int = 2048,
        straggler_factor: float = 2.0,
    ) -> None:
        """The model `entry` of a fleet whose classes are `classes` (requests that name
        none go to `default_class`; `spot_only_classes` run on spot replicas only).
        `capacity_check(pool)` says whether a pool's capacity can be had now (tests)."""
        if entry.kind != "generate":
            raise ValueError(f"GenerateService serves generate models, not {entry.kind!r}")
        name, args, routing = entry.name, entry.engine_args(), entry.routing
        self.name = name
        self.tool_parser = entry.tool_parser
        self.resilience = entry.resilience
        # Served by other fleetserve servers (pods) over HTTP: serve/remote/targets.py.
        self.remote = RemoteTargets(entry.remote) if entry.remote is not None else None
        self.pools = [self.remote.pool()] if self.remote is not None else entry.replica_plan()
        self.has_spot = any(p.is_spot for p in self.pools)
        self.spot_only_classes = spot_only_classes
        # The thread budget (given, or every CPU) is split between the replicas, as the
        # multiproc executor splits a replica's between its ranks.
        planned = max(1, sum(p.replicas + p.overprovision for p in self.pools))
        total_threads = args.num_threads or os.cpu_count() or 1
        self._replica_args = replace(args, num_threads=max(1, total_threads // planned))
        self.args = args
        self.config, self.source = args.resolve()
        self.tokenizer = Tokenizer.from_source(self.source)
        self._rules = PromptRules(self.tokenizer, self.config)
        self.metrics = metrics
        self.admission: Admission[Pending] = Admission(
            name,
            classes,
            default_class,
            metrics,
            priority_ordered=self.config.scheduler.policy == "priority",
        )
        self.queue = self.admission.queue  # read by the handlers and the dashboard
        self.replica_set = ReplicaSet(self._new_replica)
        self.replica_set.on_change = self._pulse
        policy = make_policy(
            routing,
            block_size=self.config.cache.block_size,
            seed=args.seed,
            imbalance_tokens=imbalance_tokens,
        )
        self.router: Router[Replica] = Router(
            self.replica_set.members,
            policy,
            overload_requests=self.config.scheduler.max_num_seqs,
            straggler_factor=straggler_factor,
            adapter_imbalance_tokens=imbalance_tokens,
        )
        # Migration's service side (serve/resilience/resubmit.py): moves a lost request through the router.
        self.resubmitter = RouterResubmitter(name, self.router, self.resilience, metrics, self)
        self._unstarted: Counter[str] = Counter()
        self._started = False
        self.closing = False
        self.supervisor = Supervisor(name, self.replica_set, self.resilience, metrics, self._pulse)
        self._retiring = self.supervisor.retiring  # replicas being drained or removed
        self.provisioner = LocalProvisioner(
            self.replica_set,
            self.supervisor.drain_replica,
            self._retiring,
            capacity_check=capacity_check,
            on_event=self.supervisor.event,
        )
        self.controller = PoolController(
            self.pools, self.provisioner, interval_s=SUPERVISE_INTERVAL_S
        )
        self._controller_task: asyncio.Task[None] | None = None
        # LoRA adapters served under their own names (the fleet file's `adapters:`,
        # --lora-modules, POST /v1/load_lora_adapter): serve/services/adapters.py.
        self.adapters = AdapterTable(name, self.config, args)

    def _new_replica(self, index: int, pool: PoolConfig | None) -> Replica:
        """A replica of this model in `pool`: a local engine-core process (other
        transports plug in here: a Ray actor, a remote server)."""
        pool = pool or self.pools[0]
        if self.remote is not None:
            remote = self.remote.new_replica(index, self.replica_set, self.name, self.config)
            remote.on_stats, remote.on_notice = self._publish_stats, self.supervisor.on_notice
            return remote  # type: ignore[no-any-return]
        engine = AsyncEngine(
            self._replica_args,
            _ENGINE_MAX_WAITING,
            self.metrics,
            index,
            sigterm_grace_s=self.resilience.sigterm_grace_s,
            notice=pool.notice,
        )
        replica = LocalReplica(
            index,
            engine,
            max_num_seqs=self.config.scheduler.max_num_seqs,
            oversubscribe=oversubscription(self.queue.classes),
            pool=pool.name,
            capacity=pool.capacity,
        )
        replica.on_stats = self._publish_stats
        replica.on_notice = self.supervisor.on_notice
        return replica

    # ------------------------------------------------------------- state
    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    @property
    def is_ready(self) -> bool:
        return self._started and bool(self.replica_set.live)

    @property
    def dead_reason(self) -> str | None:
        """None while any replica is alive (or loading); else why each one is down."""
        reasons = [r.dead_reason for r in self.replica_set]
        if self.recovering or (not self._started and not self.closing):
            return None  # loading, or down for now with a replacement on its way
        if not reasons:
            return "the model has no replica"
        if any(reason is None for reason in reasons):
            return None
        return "; ".join(f"replica {r.index}: {r.dead_reason}" for r in self.replica_set)

    @property
    def crashed(self) -> bool:
        """A replica's engine exited unasked and no replica took its place."""
        lost = self.supervisor.num_failed > 0 and not self.replica_set.live
        return lost or any(r.crashed for r in self.replica_set)

    @property
    def num_in_flight(self) -> int:
        return len(self.queue) + sum(r.num_outstanding_requests for r in self.replica_set)

    def card(self) -> dict[str, Any]:
        return {
            # What vLLM gives (clients load a tokenizer from it): the model's folder, or
            # for a single .gguf file the served name; the file itself is model_path.
            "root": model_root(self.config.model_path, self.name),
            "model_path": self.config.model_path,
            "max_model_len": self.max_model_len,
            "replicas": len(self.replica_set.live),
        }

    def waiting_by_class(self) -> dict[str, int]:
        return {name: self.num_waiting(name) for name in self.queue.classes}

    def num_waiting(self, class_name: str) -> int:
        """Requests of the class not started yet: queued here, or sent and not yet begun."""
        return self.queue.num_waiting(class_name) + self._unstarted[class_name]

    # ------------------------------------------------------------- lifecycle
    async def start(self, timeout_s: float = 600.0) -> None:
        """Fills the pools (the PoolController starts the replicas) and returns once they
        are up; raises if a replica fails to load and none is up. With replace_failed the
        controller keeps the pools full from then on; a supervisor watches the replicas.
        A remote model returns at once: its pods may be at zero, and requests wait for one
        (serve/admission/replica_wait.py bounds how long)."""
        self.provisioner.start_timeout_s = timeout_s
        if self.remote is not None:
            self.supervisor.spawn(self.remote.run(self))
        self._controller_task = asyncio.create_task(self.controller.run())
        deadline = time.monotonic() + timeout_s
        while True:
            await asyncio.sleep(0.05)
            if self.remote is not None:
                break  # pods come and go by themselves (to zero too): requests wait for them
            settled = self.controller.in_flight == 0 and not self.controller.actions()
            if settled and self.replica_set.live:
                break
            failed = self.provisioner.last_start_error
            idle = self.controller.in_flight == 0
            if failed is not None and idle and not self.replica_set.live:
                await self._stop_controller()
                raise RuntimeError(failed)
            if time.monotonic() > deadline:
                await self._stop_controller()
                raise RuntimeError(f"{self.name}: the replicas did not load within {timeout_s} s")
        if not self.resilience.replace_failed and self.remote is None:
            await self._stop_controller()  # (a remote pool's controller follows the pods)
        self._started = True
        self.supervisor.start()
        wait = NoReplicaWait(self.name, self.queue, lambda: bool(self.replica_set.live),
                             self.admission.shed, self.resilience.migration_wait_s)  # fmt: skip
        self.supervisor.spawn(wait.run())
        self._dispatch()

    def set_pool_target(self, pool: str, replicas: int) -> None:
        self.controller.set_target(pool, replicas)

    async def _stop_controller(self) -> None:
        self.controller.stop()
        if self._controller_task is not None:
            await asyncio.gather(self._controller_task, return_exceptions=True)
            self._controller_task = None

    async def shutdown(self) -> None:
        self.closing = True
        self.admission.close()
        self.supervisor.stop()
        await self._stop_controller()
        self.admission.fail_all(lambda: EngineDeadError("the server is shutting down"))
        await self.replica_set.stop_all()

    def abort_all(self, reason: str) -> None:
        self.admission.fail_all(lambda: EngineDeadError(reason))
        for r in self.replica_set:
            r.abort_all(reason)

    # ------------------------------------------------------------- requests
    async def admit(
        self,
        request_id: str,
        prompts: list[PromptType],
        params_for: Callable[[], SamplingParams],
        class_name: str | None = None,
        priority: int = 0,
        resume: RequestOutput | None = None,
        lora_name: str | None = None,
    ) -> list[FleetStream]:
        """Validates every prompt (ValueError naming the field), queues the request in its
        class and returns its streams once it is sent to a replica: one per prompt, all on
        their way. Raises ShedError (queue full / waited too long), EngineNotReadyError,
        EngineDeadError. Cancelling the wait takes the request out of the queue.
        `resume` (one prompt only): the output it goes on from (a gateway moved it here).
        `lora_name`: one of the model's LoRA adapters (None: the base model); an unknown
        one is UnknownAdapterError (404)."""
        if not self._started:
            if self.dead_reason is not None and self.replica_set.members:
                raise EngineDeadError(self.dead_reason)
            raise EngineNotReadyError("the model is still loading")
        if not self.replica_set.live and not self.recovering:
            raise EngineDeadError(self.dead_reason or "no replica of the model is serving")
        cls = self.admission.resolve(class_name, priority)
        lora = None if lora_name is None else self.adapters.get(lora_name)
        items = [self._prepare(f"{request_id}-{i}", p, params_for()) for i, p in enumerate(prompts)]
        for item in items:
            item.lora = lora
        if resume is not None:
            if len(items) != 1:
                raise ValueError("resume is for a request of one prompt")
            items[0].resume = resume
        pending = Pending(items, asyncio.get_running_loop().create_future(), time.monotonic())
        entry = self.admission.push(pending, cls, priority)
        self._dispatch()
        try:
            return await pending.future
        except asyncio.CancelledError:
            self.queue.remove(entry)
            fut = pending.future
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                for s in fut.result():
                    s.close()
            raise

    def _prepare(
        self, request_id: str, prompt: PromptType, params: SamplingParams
    ) -> PreparedPrompt:
        text, ids = self._rules.tokenize_prompt(prompt)
        self._rules.validate(ids, params)
        capacities = [r.kv_capacity_tokens for r in self.replica_set if r.kv_capacity_tokens]
        self._rules.fit_kv(len(ids), params, min(capacities, default=None))
        routed: dict[str, Any] = {"prompt_token_ids": ids}
        if text is not None:
            routed["prompt"] = text
        return PreparedPrompt(request_id, routed, params, len(ids))

    def _dispatch(self) -> None:
        """Sends queued requests, most important first, while some replica has room."""
        while (entry := self.queue.peek()) is not None:
            pending = entry.payload
            level = entry.service_class.priority
            no_room = {r.index for r in self.replica_set if not r.has_room(level, pending.num_seqs)}
            if entry.service_class.name in self.spot_only_classes:
                no_room |= {r.index for r in self.replica_set if r.capacity != "spot"}
            if not self.replica_set.live:
                if self.recovering:
                    return  # queued requests wait for the replacement (or their deadline)
                self.admission.fail_all(
                    lambda: EngineDeadError(self.dead_reason or "no replica is serving")
                )
                return
            if all(r.index in no_room for r in self.replica_set.live):
                return  # the head waits for room; nothing behind it has more
            self.queue.pop()
            self._send(entry, no_room)

    def _send(self, entry: Entry[Pending], no_room: set[int]) -> None:
        pending = entry.payload
        cls = entry.service_class
        streams: list[FleetStream] = []
        try:
            for item in pending.items:
                route = RouteRequest(
                    item.request_id,
                    tuple(item.prompt["prompt_token_ids"]),
                    (item.params.max_tokens or 0) * item.params.n,
                    entry.priority,
                    None if item.lora is None else item.lora.lora_name,
                )
                narrow = self.narrow(cls.name)
                try:
                    replica = self.router.choose(route, exclude=no_room, narrow=narrow)
                except NoHealthyReplicaError:
                    # Later prompts of a wide request.
                    replica = self.router.choose(route, narrow=narrow)
                observer = ClassObserver(self.metrics, cls.name, pending.arrival, self._unstarted)
                try:
                    inner = replica.submit(
                        item.request_id,
                        item.prompt,
                        copy.copy(item.params),
                        engine_priority(cls, entry.priority),
                        item.num_prompt_tokens,
                        level=cls.priority,
                        resume=item.resume,
                        lora_request=item.lora,
                    )
                except BaseException:
                    observer.on_end()  # it never started
                    raise
                state = request_state(item, entry, replica.index)
                stream = FleetStream(
                    state,
                    inner,
                    self.resubmitter,
                    observer=observer,
                    migration_limit=self.resilience.migration_limit,
                    hedge=hedge_for(cls.hedge_after_s, self.resubmitter.resubmit, self.metrics),
                    context=SentRequest(item, cls, state.priority),
                )
                streams.append(stream)
        except Exception as e:
            for s in streams:
                s.close()
            if not pending.future.done():
                pending.future.set_exception(e)
            return
        if pending.future.done():  # the client left while it was being sent
            for s in streams:
                s.close()
            return
        pending.future.set_result(streams)

    def narrow(self, class_name: str) -> Narrow | None:
        """Spot first: among the router's candidates, the spot replicas with room, unless
        none has; a class pinned to spot gets spot replicas only."""
        if not self.has_spot:
            return None
        spot_only = class_name in self.spot_only_classes
        overload = self.router.overload_requests
        return lambda cands: prefer_spot(cands, overload, spot_only)

    # ------------------------------------------------------------- recovery
    @property
    def recovering(self) -> bool:
        """A replica is loading (or will be started) that queued requests may wait for."""
        if self.closing or not self._started:
            return False
        if self.remote is not None:  # a pod may appear any time (KEDA scales from zero)
            return self._controller_task is not None
        loading = any(
            r.dead_reason is None and not r.healthy and r.index not in self._retiring
            for r in self.replica_set
        )
        if loading or self.controller.in_flight > 0:
            return True
        # The controller will start a replacement, unless its pools are backing off.
        return self._controller_task is not None and any(self.controller.available().values())

    # ------------------------------------------------------------- supervision
    def _pulse(self) -> None:
        """Routable replicas changed: wake migrations waiting for one, replan the pools,
        send what waits."""
        self.resubmitter.wake()
        self.controller.poke()
        self._dispatch()

    def start_drain(self, index: int, timeout_s: float) -> bool:
        return self.supervisor.start_drain(index, timeout_s)

    async def drain_replica(self, index: int, timeout_s: float) -> bool:
        return await self.supervisor.drain_replica(index, timeout_s)

    def replica_views(self) -> list[dict[str, Any]]:
        return self.supervisor.replica_views()

    def _publish_stats(self, replica: Replica) -> None:
        publish_pooled_stats(self.metrics, self.replica_set.live)


def request_state(item: PreparedPrompt, entry: Entry[Pending], replica_index: int) -> RequestState:
    """A sent engine request's state; its fold starts from `item.resume` (a request a
    gateway moved here: what its reader has, which a move here goes on from)."""
    cls = entry.service_class
    params = item.params
    return RequestState(
        item.request_id,
        params.n,
        cls.name,
        engine_priority(cls, entry.priority),
        entry.payload.arrival,
        OutputFold(item.request_id, params.n, start=item.resume),
        replica_index,
        queue_deadline=None if entry.deadline == float("inf") else entry.deadline,
    )
