"""Model services for batch-at-once models (embed, custom): a model plus its MicroBatcher.

Each service is what the fleet registry holds under a model name. `start()` loads the model
on a worker thread (the event loop keeps serving other models meanwhile); every input item
of a request is one batcher item, so items of different requests share batches.

Errors a caller sees from `embed` / `predict`:
- `ValueError` naming the field: the request's input is bad (HTTP 400), before queueing;
- `ServiceNotReadyError`, `MicroBatchOverloadedError`, `MicroBatchStoppedError`: HTTP 503;
- `MicroBatchItemError(index, error)`: item `index` failed in the model; `error` says why.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

import numpy as np

from fleetserve.engine.embedding_result import EmbeddingResult
from fleetserve.serve.microbatch.batcher import MicroBatchConfig, MicroBatcher, MicroBatchError
from fleetserve.serve.microbatch.custom import (
    Instance,
    Prediction,
    parse_handler_spec,
    validate_instances,
)
from fleetserve.serve.microbatch.isolated import DEFAULT_TIMEOUT_S, HandlerProcess

if TYPE_CHECKING:
    from fleetserve.engine.embedding import EmbeddingModel

T = TypeVar("T")
R = TypeVar("R")
OnBatch = Callable[[int, float], None]


class ServiceNotReadyError(MicroBatchError):
    """The model is still loading (or failed to load): HTTP 503."""


class MicroBatchModelBase:
    """What every embed or custom model's service shares, in the API process here or on
    Ray (ray/microbatch_clients.py): it has no engine process of its own to lose, so it is
    never dead (the batcher, or Serve, fails what it cannot run) and never crashed."""

    name: str

    @property
    def dead_reason(self) -> str | None:
        """Why it can never serve again: None."""
        return None

    @property
    def crashed(self) -> bool:
        return False

    def not_ready(self, why: str) -> ServiceNotReadyError:
        return ServiceNotReadyError(f"model {self.name!r} {why}")


class _MicroBatchService(MicroBatchModelBase, abc.ABC, Generic[T, R]):
    def __init__(self, name: str, batching: MicroBatchConfig, on_batch: OnBatch | None) -> None:
        self.name = name
        self.batching = batching
        self.batcher: MicroBatcher[T, R] = MicroBatcher(
            self._run_batch,
            max_batch_size=batching.max_batch_size,
            batch_wait_timeout_s=batching.batch_wait_timeout_s,
            max_waiting=batching.max_waiting,
            on_batch=on_batch,
            name=name,
        )
        self._loaded = False
        self._stopping = False

    @property
    def is_ready(self) -> bool:
        """Loaded and taking requests (False while loading and once shutdown began)."""
        return self._loaded and not self._stopping

    @property
    def num_waiting(self) -> int:
        """Items queued for a batch: the queue depth an autoscaler reads."""
        return self.batcher.num_waiting

    @property
    def num_in_flight(self) -> int:
        return self.batcher.num_waiting + self.batcher.num_running

    def waiting_by_class(self) -> dict[str, int]:
        """Its one queue (no service classes): the label `class` is empty."""
        return {"": self.num_waiting}

    def card(self) -> dict[str, Any]:
        """Its /v1/models entry beyond id, object, created, owned_by and kind."""
        return {
            "max_batch_size": self.batching.max_batch_size,
            "batch_wait_timeout_s": self.batching.batch_wait_timeout_s,
        }

    def abort_all(self, reason: str) -> None:
        """Fails what is queued (MicroBatchStoppedError, 503) and takes nothing new."""
        self._stopping = True
        asyncio.ensure_future(self.batcher.stop(timeout_s=0))

    async def start(self, timeout_s: float = 600.0) -> None:
        """Load the model on a worker thread; raises what loading raised."""
        try:
            await asyncio.wait_for(asyncio.to_thread(self._load), timeout_s)
        except (TimeoutError, asyncio.TimeoutError):
            raise RuntimeError(f"the model did not load within {timeout_s:.0f} s") from None
        self._loaded = True

    async def shutdown(self, timeout_s: float | None = None) -> None:
        """Stop taking requests and finish the queued ones (within `timeout_s`, after which
        the rest fail with MicroBatchStoppedError)."""
        self._stopping = True
        if timeout_s is None:
            await self.batcher.drain()
            return
        try:
            await asyncio.wait_for(asyncio.shield(self.batcher.drain()), timeout_s)
        except asyncio.TimeoutError:
            await self.batcher.stop(timeout_s=0)

    def check_ready(self) -> None:
        if not self._loaded:
            raise self.not_ready("is not loaded yet")
        if self._stopping:
            raise self.not_ready("is shutting down")

    @abc.abstractmethod
    def _load(self) -> None:
        """Worker thread: load the model."""

    @abc.abstractmethod
    def _run_batch(self, items: list[T]) -> Sequence[R | Exception]:
        """The batcher's worker thread: one result (or Exception) per item, in order."""


# An embed item is a validated input (text, or token ids); its result is its vector and
# the number of tokens the model read for it.
EmbedItem = str | tuple[int, ...]
EmbedOutput = tuple[np.ndarray, int]


class EmbedService(_MicroBatchService[EmbedItem, EmbedOutput]):
    """`model`: a sentence-transformers folder, or `all-MiniLM-L6-v2`."""

    kind: Literal["embed"] = "embed"

    def __init__(
        self,
        name: str,
        model: str,
        *,
        batching: MicroBatchConfig | None = None,
        on_batch: OnBatch | None = None,
    ) -> None:
        super().__init__(name, batching or MicroBatchConfig(), on_batch)
        self.model_path = model
        self._model: EmbeddingModel | None = None

    @property
    def model(self) -> EmbeddingModel:
        if self._model is None:
            raise self.not_ready("is not loaded yet")
        return self._model

    @property
    def dimension(self) -> int:
        return self.model.dimension

    def card(self) -> dict[str, Any]:
        card = super().card()
        if self._model is not None:
            card["dimension"] = self._model.dimension
        return card

    async def embed(self, inputs: Sequence[str] | Sequence[Sequence[int]]) -> EmbeddingResult:
        """One vector per input; each input is one batcher item. Texts are tokenized on the
        batch's thread, all of a batch's texts in one call."""
        self.check_ready()
        items = self.model.validate(inputs)  # ValueError naming input[i]
        outputs = await self.batcher.submit_many(items)
        return EmbeddingResult(np.stack([v for v, _ in outputs]), [n for _, n in outputs])

    def _load(self) -> None:
        from fleetserve.engine.embedding import EmbeddingModel  # torch: only once one loads

        self._model = EmbeddingModel.load(self.model_path)

    def _run_batch(self, items: list[EmbedItem]) -> list[EmbedOutput]:
        result = self.model.embed_ids(self.model.tokenize(items))
        # Rows of one batch array: each item's vector, without a copy.
        return list(zip(result.vectors, result.num_tokens, strict=True))


class CustomService(_MicroBatchService[Instance, Prediction]):
    """`handler`: "package.module:ClassName"; `options` go to its __init__ as keywords."""

    kind: Literal["custom"] = "custom"

    def __init__(
        self,
        name: str,
        handler: str,
        *,
        options: dict[str, Any] | None = None,
        batching: MicroBatchConfig | None = None,
        on_batch: OnBatch | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        memory_limit_mb: int | None = None,
    ) -> None:
        parse_handler_spec(handler)  # a malformed spec fails here, before anything loads
        super().__init__(name, batching or MicroBatchConfig(), on_batch)
        self.handler = handler
        self.options = dict(options or {})
        # The handler runs in a process of its own (serve/microbatch/isolated.py).
        self._model = HandlerProcess(name, handler, self.options, timeout_s, memory_limit_mb)
        # Every request of the running batch gone (clients left): its sub-calls end too.
        self.batcher.on_abandon = self._model.cancel_sub_calls
        # id(instance) -> the class of the request it came in (its sub-calls' class) and
        # where that request's sub-calls are recorded (its access-log line).
        self._scopes: dict[int, tuple[str | None, list[Any] | None]] = {}

    def bind_fleet(self, call: Any, loop: asyncio.AbstractEventLoop) -> None:
        """Its handler's sub-calls run with `call` on `loop` (serve/microbatch/isolated.py)."""
        self._model.bind_fleet(call, loop)

    @property
    def model(self) -> HandlerProcess:
        return self._model

    @property
    def unhealthy_reason(self) -> str | None:
        """Why a loaded model cannot serve now (its handler's process restarting, or a
        call stuck past half its timeout); None when it can."""
        return self._model.unhealthy_reason if self._loaded else None

    @property
    def is_ready(self) -> bool:
        return super().is_ready and self.unhealthy_reason is None

    def card(self) -> dict[str, Any]:
        return {**super().card(), "timeout_s": self._model.timeout_s}

    async def shutdown(self, timeout_s: float | None = None) -> None:
        try:
            await super().shutdown(timeout_s)
        finally:
            await asyncio.to_thread(self._model.stop)

    def abort_all(self, reason: str) -> None:
        super().abort_all(reason)
        self._model.stop()

    async def predict(
        self,
        instances: Sequence[Instance],
        class_name: str | None = None,
        sub_calls: list[Any] | None = None,
    ) -> list[Prediction]:
        """One prediction per instance; each instance is one batcher item. `class_name`:
        the request's class, which its handler's sub-calls are admitted in (a micro-batch
        mixing requests of several classes: the strictest of them, fleet_client.py).
        `sub_calls`: each sub-call of a batch holding this request is appended there."""
        self.check_ready()
        items = validate_instances(instances)
        for item in items:
            self._scopes[id(item)] = (class_name, sub_calls)
        try:
            return await self.batcher.submit_many(items)
        finally:
            for item in items:
                self._scopes.pop(id(item), None)

    def _load(self) -> None:
        self._model.start()

    def _run_batch(self, items: list[Instance]) -> list[Prediction | Exception]:
        scopes = [self._scopes.get(id(item), (None, None)) for item in items]
        sinks = list({id(s): s for _, s in scopes if s is not None}.values())
        return self.model(items, frozenset(c for c, _ in scopes), sinks)
