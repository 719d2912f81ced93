"""The ingress's clients of the embed and custom deployments: service-like objects that
the local server's handlers and registry take as they take EmbedService / CustomService,
backed by Serve deployment handles. Their queue is the replicas' dynamic batchers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ray.serve.handle import DeploymentHandle

from fleetserve.engine.embedding_result import EmbeddingResult
from fleetserve.ray.fleet_client import Predicted
from fleetserve.ray.router_state import num_known_replicas
from fleetserve.ray.streams import short
from fleetserve.ray.wire import RemoteError
from fleetserve.serve.config.fleet_config import ModelEntry
from fleetserve.serve.microbatch.custom import validate_instances
from fleetserve.serve.microbatch.services import MicroBatchModelBase


class _RayMicroBatchClient(MicroBatchModelBase):
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
            raise self.not_ready("is not ready")

    async def _call(self, method: str, *args: Any) -> Any:
        self.check_ready()
        self.num_calls += 1
        try:
            result = await getattr(self.handle, method).remote(*args)
        except Exception as e:  # noqa: BLE001 -- the replica (or its node) is gone
            raise RuntimeError(f"the replica serving the request failed: {short(e)}") from e
        finally:
            self.num_calls -= 1
        if isinstance(result, RemoteError):
            raise result.exception(batch=True)
        return result


class RayEmbedClient(_RayMicroBatchClient):
    kind = "embed"

    def __init__(self, entry: ModelEntry, handle: DeploymentHandle) -> None:
        super().__init__(entry, handle)
        self._dimension: int | None = None

    @property
    def dimension(self) -> int:
        if self._dimension is None:
            raise self.not_ready("is not ready")
        return self._dimension

    def check_ready(self) -> None:
        super().check_ready()
        if self._dimension is None:
            raise self.not_ready("is still loading")

    async def start(self, timeout_s: float = 600.0) -> None:
        await super().start(timeout_s)
        # Asked of a replica once; with min_replicas 0 this wakes one.
        self._dimension = int(await self.handle.dimension.remote())

    async def embed(self, inputs: Sequence[str] | Sequence[Sequence[int]]) -> EmbeddingResult:
        vectors, num_tokens = await self._call("embed", list(inputs))
        return EmbeddingResult(vectors, list(num_tokens))


class RayCustomClient(_RayMicroBatchClient):
    kind = "custom"

    async def predict(
        self,
        instances: Sequence[Mapping[str, Any]],
        class_name: str | None = None,
        sub_calls: list[Any] | None = None,
    ) -> list[dict[str, Any]]:
        """`class_name`: the request's class, which the handler's sub-calls (through the
        ingress, fleet_client.py) are admitted in; they are appended to `sub_calls`."""
        result: Predicted = await self._call("predict", validate_instances(instances), class_name)
        if sub_calls is not None:
            sub_calls.extend(result.sub_calls)
        return result.predictions
