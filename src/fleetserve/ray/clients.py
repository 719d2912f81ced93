"""The ingress's side of each model deployment: service-like objects that the local
server's handlers and registry take as they take GenerateService / EmbedService /
CustomService, backed by Serve deployment handles.

A generate request goes through the same steps as on the local server, in the ingress:
tokenize and validate (400s), its class's queue (serve/sla.py: ordered by class, then the
request's priority, then deadline; 503 when the class is full or its max_queue_time_s
passes), then dispatch while the model has room: in-flight requests below its replicas
times `max_ongoing_requests` (one replica's worth when none is known yet, so that the
first request reaches Serve and wakes a scaled-to-zero deployment). Serve's router (ours,
router.py) then picks the replica, and the engine's priority scheduler orders what it holds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from fleetserve.core.sampling_params import SamplingParams
from fleetserve.engine.async_engine import EngineDeadError
from fleetserve.engine.embedding import EmbeddingResult
from fleetserve.engine.llm_engine import PromptRules, PromptType
from fleetserve.metrics import ModelMetrics
from fleetserve.outputs import RequestOutput
from fleetserve.ray import router_state
from fleetserve.ray.router_state import num_known_replicas
from fleetserve.ray.wire import RemoteError
from fleetserve.serve.admission import ShedError
from fleetserve.serve.batch_service import ServiceNotReadyError
from fleetserve.serve.fleet_config import FleetConfig, ModelEntry
from fleetserve.serve.sla import ClassQueue, Entry, QueueFullError, engine_priority
from fleetserve.tokenizer import Tokenizer


@dataclass
class _Item:
    request_id: str
    prompt: dict[str, Any]
    params: SamplingParams
    num_prompt_tokens: int
    num_new_tokens: int


@dataclass
class _Pending:
    """A queued request; `turn` resolves when it may be sent (its seats are reserved)."""

    items: list[_Item]
    turn: asyncio.Future[None]
    arrival: float


class RayStream:
    """One request's outputs from a generate deployment (`ReplicaStreamLike`). A replica
    lost mid-stream (its node left) ends the stream with EngineDeadError at once."""

    def __init__(
        self, client: RayGenerateClient, request_id: str, n: int, gen: DeploymentResponseGenerator
    ) -> None:
        self.client, self.request_id, self.n, self._gen = client, request_id, n, gen
        self.class_name = ""
        self.arrival = time.monotonic()
        self._first: float | None = None
        self._done = False

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
            raise EngineDeadError(f"the replica serving the request failed: {_short(e)}") from e
        if isinstance(item, RemoteError):
            self.close()
            raise item.exception(batch=False)
        self._observe(item)
        if item.finished:
            self._end()
        return item

    def _observe(self, out: RequestOutput) -> None:
        now = time.monotonic()
        if self._first is None:
            self._first = now
        metrics = self.client.metrics
        if out.finished and metrics is not None:
            num_tokens = sum(len(c.token_ids) for c in out.outputs)
            metrics.add_prompt_tokens(len(out.prompt_token_ids))
            metrics.add_generation_tokens(num_tokens)
            metrics.observe_finished(out)
            metrics.observe_latency(
                self.class_name, self._first - self.arrival, now - self.arrival, num_tokens
            )

    def _end(self) -> None:
        if not self._done:
            self._done = True
            self.client._finished(self)

    def close(self) -> None:
        """Aborts the request in its replica if it has not finished."""
        if not self._done:
            self._gen.cancel()
        self._end()


def _short(e: BaseException) -> str:
    return str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__


class RayGenerateClient:
    kind = "generate"

    def __init__(
        self,
        entry: ModelEntry,
        fleet: FleetConfig,
        handle: DeploymentHandle,
        max_ongoing_requests: int,
        metrics: ModelMetrics | None = None,
    ) -> None:
        self.name = entry.name
        self.handle = handle
        self.deployment_name = handle.deployment_name
        self.metrics = metrics
        self.max_ongoing_requests = max_ongoing_requests
        args = entry.engine_args()
        self.config, source = args.resolve()
        self.tokenizer = Tokenizer.from_source(source)
        self._rules = PromptRules(self.tokenizer, self.config)
        self.priority_ordered = self.config.scheduler.policy == "priority"
        self.queue: ClassQueue[_Pending] = ClassQueue(
            fleet.service_classes(), fleet.default_class_name
        )
        self.num_in_flight_streams = 0
        self._started = False
        self._expiry: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------- ModelService
    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    @property
    def is_ready(self) -> bool:
        return self._started

    @property
    def dead_reason(self) -> str | None:
        return None  # Serve replaces dead replicas; a lost one fails only its requests

    @property
    def crashed(self) -> bool:
        return False

    @property
    def num_in_flight(self) -> int:
        return len(self.queue) + self.num_in_flight_streams

    def card(self) -> dict[str, Any]:
        return {
            "root": self.config.model_path,
            "max_model_len": self.max_model_len,
            "replicas": num_known_replicas(self.deployment_name) or 0,
        }

    def waiting_by_class(self) -> dict[str, int]:
        return {name: self.queue.num_waiting(name) for name in self.queue.classes}

    async def start(self, timeout_s: float = 600.0) -> None:
        loop = asyncio.get_running_loop()

        def replicas_changed() -> None:
            # More replicas, more room: queued requests need not wait for one to finish.
            # (Serve may run the handle's router on a thread of its own.)
            loop.call_soon_threadsafe(self._dispatch)

        router_state.LISTENERS.setdefault(self.deployment_name, []).append(replicas_changed)
        self._started = True

    async def shutdown(self) -> None:
        self.abort_all("the server is shutting down")

    def abort_all(self, reason: str) -> None:
        while (entry := self.queue.pop()) is not None:
            if not entry.payload.turn.done():
                entry.payload.turn.set_exception(EngineDeadError(reason))

    # ------------------------------------------------------------- admission
    @property
    def capacity(self) -> int:
        """Requests the model's replicas take at once (one replica's worth while Serve
        has none or the router has not seen them yet)."""
        return max(num_known_replicas(self.deployment_name) or 1, 1) * self.max_ongoing_requests

    async def admit(
        self,
        request_id: str,
        prompts: list[PromptType],
        params_for: Callable[[], SamplingParams],
        class_name: str | None = None,
        priority: int = 0,
    ) -> list[RayStream]:
        """As GenerateService.admit: validate, queue by class, return the streams once
        dispatched. Cancelling the wait takes the request out of the queue.

        The request is sent from its own task, once its turn comes: a Serve handle call
        belongs to the HTTP request whose context makes it (its request id, its
        cancellation), so it must not be made from another request's task."""
        cls = self.queue.resolve(class_name)
        if priority != 0 and not self.priority_ordered:
            raise ValueError(
                f"priority is not honoured by {self.name!r}: it schedules first-come "
                "first-served; serve it with scheduling_policy priority to order by priority"
            )
        items = [self._prepare(f"{request_id}-{i}", p, params_for()) for i, p in enumerate(prompts)]
        arrival = time.monotonic()
        loop = asyncio.get_running_loop()
        pending = _Pending(items, loop.create_future(), arrival)
        try:
            entry = self.queue.push(pending, cls.name, priority, arrival)
        except QueueFullError as e:
            self._shed(cls.name, "queue_full")
            raise ShedError(str(e), cls.name, "overloaded") from None
        self._schedule_expiry()
        self._dispatch()
        try:
            await pending.turn
        except asyncio.CancelledError:
            if not self.queue.remove(entry) and pending.turn.done():
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
            entry.payload.turn.set_result(None)

    def _release(self, num_streams: int) -> None:
        self.num_in_flight_streams -= num_streams
        self._dispatch()

    def _send(self, entry: Entry[_Pending]) -> list[RayStream]:
        pending = entry.payload
        caller = self.handle.options(stream=True)
        streams: list[RayStream] = []
        try:
            for item in pending.items:
                streams.append(self._call(caller, item, entry))
        except BaseException:
            for s in streams:
                s.close()  # gives its seat back
            self._release(len(pending.items) - len(streams))
            raise
        return streams

    def _call(self, caller: DeploymentHandle, item: _Item, entry: Entry[_Pending]) -> RayStream:
        cls = entry.service_class
        gen = caller.generate.remote(
            request_id=item.request_id,
            prompt=item.prompt,
            params=item.params,
            priority=engine_priority(cls, entry.priority),
            num_prompt_tokens=item.num_prompt_tokens,
            num_new_tokens=item.num_new_tokens,
            level=cls.priority,
        )
        assert isinstance(gen, DeploymentResponseGenerator)  # stream=True
        stream = RayStream(self, item.request_id, item.params.n, gen)
        stream.class_name, stream.arrival = cls.name, entry.payload.arrival
        return stream

    def _finished(self, stream: RayStream) -> None:
        self._release(1)

    def _schedule_expiry(self) -> None:
        deadline = self.queue.next_deadline()
        if deadline == float("inf"):
            return
        if self._expiry is not None and self._expiry.when() <= deadline:
            return
        if self._expiry is not None:
            self._expiry.cancel()
        self._expiry = asyncio.get_running_loop().call_at(deadline, self._expire)

    def _expire(self) -> None:
        self._expiry = None
        for entry in self.queue.expire(time.monotonic()):
            cls = entry.service_class
            self._shed(cls.name, "queue_timeout")
            if not entry.payload.turn.done():
                entry.payload.turn.set_exception(
                    ShedError(
                        f"the request waited {cls.max_queue_time_s:g} s in the {cls.name!r} "
                        "queue (its max_queue_time_s) without starting; try again later",
                        cls.name,
                        "queue_timeout",
                    )
                )
        self._schedule_expiry()

    def _shed(self, class_name: str, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.add_shed(class_name, reason)


class _RayBatchClient:
    """An embed or custom deployment behind its handle; its queue is the replicas'."""

    def __init__(self, entry: ModelEntry, handle: DeploymentHandle) -> None:
        self.name = entry.name
        self.handle = handle
        self.deployment_name = handle.deployment_name
        self.batching = entry.batching
        self.num_calls = 0
        self._started = False

    @property
    def is_ready(self) -> bool:
        return self._started

    @property
    def dead_reason(self) -> str | None:
        return None

    @property
    def crashed(self) -> bool:
        return False

    @property
    def num_in_flight(self) -> int:
        return self.num_calls

    def card(self) -> dict[str, Any]:
        return {"replicas": num_known_replicas(self.deployment_name) or 0}

    def waiting_by_class(self) -> dict[str, int]:
        return {}  # waiting items are counted by the replicas (record_autoscaling_stats)

    async def start(self, timeout_s: float = 600.0) -> None:
        self._started = True

    async def shutdown(self) -> None:
        self._started = False

    def abort_all(self, reason: str) -> None:
        self._started = False

    def check_ready(self) -> None:
        if not self._started:
            raise ServiceNotReadyError(f"model {self.name!r} is not ready")

    async def _call(self, method: str, arg: Any) -> Any:
        self.check_ready()
        self.num_calls += 1
        try:
            result = await getattr(self.handle, method).remote(arg)
        except Exception as e:  # noqa: BLE001 -- the replica (or its node) is gone
            raise RuntimeError(f"the replica serving the request failed: {_short(e)}") from e
        finally:
            self.num_calls -= 1
        if isinstance(result, RemoteError):
            raise result.exception(batch=True)
        return result


class RayEmbedClient(_RayBatchClient):
    kind = "embed"

    def __init__(self, entry: ModelEntry, handle: DeploymentHandle) -> None:
        super().__init__(entry, handle)
        self._dimension: int | None = None

    @property
    def dimension(self) -> int:
        if self._dimension is None:
            raise ServiceNotReadyError(f"model {self.name!r} is not ready")
        return self._dimension

    def check_ready(self) -> None:
        super().check_ready()
        if self._dimension is None:
            raise ServiceNotReadyError(f"model {self.name!r} is still loading")

    async def start(self, timeout_s: float = 600.0) -> None:
        await super().start(timeout_s)
        # Asked of a replica once; with min_replicas 0 this wakes one.
        self._dimension = int(await self.handle.dimension.remote())

    async def embed(self, inputs: Sequence[str] | Sequence[Sequence[int]]) -> EmbeddingResult:
        vectors, num_tokens = await self._call("embed", list(inputs))
        return EmbeddingResult(vectors, list(num_tokens))


class RayCustomClient(_RayBatchClient):
    kind = "custom"

    async def predict(self, instances: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        if not instances:
            raise ValueError("instances must not be empty")
        for i, inst in enumerate(instances):
            if not isinstance(inst, dict):
                raise ValueError(f"instances[{i}] must be a JSON object")
        result: list[dict[str, Any]] = await self._call("predict", list(instances))
        return result
