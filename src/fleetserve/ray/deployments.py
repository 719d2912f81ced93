"""What runs inside one Serve replica of a model: a generate replica is one fleetserve
engine (AsyncEngine + its EngineCore process, behind the same LocalReplica the local
server uses); an embed or custom replica is the local EmbedService / CustomService with
its dynamic batcher.

Refusals travel back as `RemoteError` values, not exceptions (see wire.py). A replica
reports its load to Serve twice: `record_routing_stats` for the ingress's router (step
latency, queue depth, prefix cache), `record_autoscaling_stats` for the queue-depth
autoscaling policy (autoscale.py). `check_health` fails once the engine process is gone,
hung or drained after a notice (health.py's EngineWatch), and Serve replaces the replica.
A request this replica can no longer serve (its engine died or hung, it is draining,
Serve is stopping it) ends with a "gone" RemoteError, so that the ingress resumes it on
another replica (`generate(resume=...)`, request migration; clients.py).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from fleetserve.cloud.notices import NoticeConfig
from fleetserve.core.lora_request import LoRARequest
from fleetserve.core.sampling_params import SamplingParams
from fleetserve.engine.arg_utils import EngineArgs
from fleetserve.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    ReplicaGoneError,
)
from fleetserve.engine.delta_stream import ReplicaRefusedError
from fleetserve.engine.embedding_result import MINILM_NAME
from fleetserve.engine.stats import EngineStats
from fleetserve.entrypoints.openai.fleet_client import SubCall
from fleetserve.outputs import RequestOutput
from fleetserve.ray.fleet_client import INGRESS_DEPLOYMENT, HandleFleetCall, Predicted
from fleetserve.ray.health import EngineWatch
from fleetserve.ray.wire import RemoteError
from fleetserve.serve.config.fleet_config import ResilienceConfig
from fleetserve.serve.microbatch.batcher import MicroBatchConfig
from fleetserve.serve.microbatch.services import CustomService, EmbedService
from fleetserve.serve.replicas.local import LocalReplica

# Each request is one the ingress let through its class queue; the engine never refuses.
_ENGINE_MAX_WAITING = 1 << 20


def _app_name() -> str | None:
    from ray import serve

    try:
        return str(serve.get_replica_context().app_name)
    except RuntimeError:  # not in a Serve replica (unit tests)
        return None


def _node_id() -> str:
    import ray

    return str(ray.get_runtime_context().get_node_id())


def lost_as_gone(e: Exception, replica: Any) -> Exception:
    """A dead or stopping engine's refusal as ReplicaGoneError: another replica can take
    the request (the ingress resumes it there), so it must not read as final. `replica`:
    the LocalReplica (its dead_reason and draining)."""
    gone = replica.dead_reason is not None or replica.draining
    if gone and isinstance(e, EngineDeadError) and not isinstance(e, ReplicaGoneError):
        return ReplicaGoneError(str(e))
    return e


class GenerateReplica:
    """One engine. `args` are the model entry's EngineArgs (num_threads: the replica's);
    `resilience` its hang timeout and SIGTERM grace; `notice` its spot pool's cloud notice
    config (the engine process polls its own node's metadata endpoint, as on the local
    server; a notice drains the replica through EngineWatch)."""

    async def __init__(  # type: ignore[misc]
        self,
        model_name: str,
        args: EngineArgs,
        resilience: ResilienceConfig | None = None,
        notice: dict[str, Any] | None = None,
    ) -> None:
        self.model_name = model_name
        resilience = resilience or ResilienceConfig()
        if args.num_threads is None:
            args = replace(args, num_threads=1)
        engine = AsyncEngine(
            args,
            _ENGINE_MAX_WAITING,
            sigterm_grace_s=resilience.sigterm_grace_s,
            notice=NoticeConfig(**notice) if notice is not None else None,
        )
        self.engine = engine
        self.replica = LocalReplica(0, engine, max_num_seqs=engine.config.scheduler.max_num_seqs)
        self.watch = EngineWatch(model_name, self.replica, resilience)
        await self.replica.start()
        self.watch.start()

    async def generate(
        self,
        *,
        request_id: str,
        prompt: dict[str, Any],
        params: SamplingParams,
        priority: int,
        num_prompt_tokens: int,
        num_new_tokens: int,
        level: int,
        resume: RequestOutput | None = None,
        avoid: Sequence[int] = (),
        lora: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput | RemoteError]:
        """The request's deltas (what is new since the previous yield; merged when the
        ingress fell behind), as the engine hands them: nothing is folded or diffed here.
        A refusal or failure is one RemoteError and the end. `resume`: the request's
        whole output so far as the ingress saw it on a replica it lost; it goes on from there
        (request migration). `num_new_tokens` and `avoid` are for the ingress's router
        only. Cancelling the call (the client left) aborts the request."""
        if self.watch.draining:
            yield RemoteError.of(ReplicaRefusedError("the replica is draining"))
            return
        try:
            stream = self.replica.submit(
                request_id, prompt, params, priority, num_prompt_tokens, level=level,
                resume=resume, lora_request=lora,
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 -- every refusal goes back as data
            yield RemoteError.of(lost_as_gone(e, self.replica))
            return
        try:
            async for out in stream:
                yield out
        except Exception as e:  # noqa: BLE001
            yield RemoteError.of(lost_as_gone(e, self.replica))
        finally:
            stream.close()

    async def record_routing_stats(self) -> dict[str, Any]:
        r = self.replica
        stats = r.stats or EngineStats()
        return {
            "step_latency_s": r.step_latency_s,
            "num_outstanding_requests": r.num_outstanding_requests,
            "num_outstanding_tokens": r.num_outstanding_tokens,
            "num_requests_waiting": r.queue_depth,
            "prefix_cache_queries": stats.prefix_cache_queries,
            "prefix_cache_hits": stats.prefix_cache_hits,
            "kv_cache_usage_perc": stats.kv_cache_usage_perc,
            "num_requests_running": float(stats.num_requests_running),
            "draining": self.watch.draining,
            # The adapters it holds (loaded, in its CPU cache, or being loaded): the
            # router prefers it for their requests (serve/routing/adapters.py).
            "lora_adapters": sorted(r.lora_names),
            # Its engine's adapter loads and evictions so far (per-adapter metrics).
            "lora_loads": dict(self.engine.lora_loads),
            "lora_evictions": dict(self.engine.lora_evictions),
        }

    async def record_autoscaling_stats(self) -> dict[str, float]:
        stats = self.replica.stats or EngineStats()
        running = float(stats.num_requests_running)
        # Sent to the engine but not yet scheduled there, plus the scheduler's own queue.
        waiting = float(max(self.replica.num_outstanding_requests - running, 0.0))
        return {
            "num_running": running,
            "num_waiting": waiting,
            "kv_cache_usage": stats.kv_cache_usage_perc,
        }

    def check_health(self) -> None:
        reason = self.watch.health_error()
        if reason is not None:
            raise RuntimeError(f"the replica of {self.model_name!r} must be replaced: {reason}")

    async def info(self) -> dict[str, Any]:
        """Where it runs and its engine's counters (tests, `fleetserve` tooling)."""
        return {
            "node_id": _node_id(),
            "pid": os.getpid(),
            "core_pid": self.replica.engine.core_pid,
            "num_routed": self.replica.num_routed,
            "num_requests": self.replica.num_outstanding_requests,
            "stats": (self.replica.stats or EngineStats()).as_metrics(),
        }

    async def __del__(self) -> None:
        self.watch.stop()
        await self.replica.stop()


class MicroBatchReplica:
    """An embed or custom model with its dynamic batcher (fleet_config's model entry). A
    custom handler's fleet client reaches the fleet through the `ingress` deployment of
    this replica's application (fleet_client.py)."""

    async def __init__(  # type: ignore[misc]
        self, entry: dict[str, Any], ingress: str = INGRESS_DEPLOYMENT
    ) -> None:
        batching = MicroBatchConfig(**(entry.get("batching") or {}))
        self.service: EmbedService | CustomService
        if entry["kind"] == "embed":
            self.service = EmbedService(
                entry["name"], entry.get("model") or MINILM_NAME, batching=batching
            )
        else:
            limits = {k: entry[k] for k in ("timeout_s", "memory_limit_mb") if entry.get(k)}
            self.service = CustomService(
                entry["name"], entry["handler"], options=entry["options"], batching=batching,
                **limits,
            )  # fmt: skip
            call = HandleFleetCall(entry["name"], _app_name(), ingress)
            self.service.bind_fleet(call, asyncio.get_running_loop())
        await self.service.start()

    async def dimension(self) -> int:
        assert isinstance(self.service, EmbedService)
        return self.service.dimension

    async def embed(
        self, inputs: Sequence[str] | Sequence[Sequence[int]]
    ) -> tuple[np.ndarray, list[int]] | RemoteError:
        assert isinstance(self.service, EmbedService)
        try:
            result = await self.service.embed(inputs)
        except Exception as e:  # noqa: BLE001 -- every refusal goes back as data
            return RemoteError.of(e)
        return result.vectors, result.num_tokens

    async def predict(
        self, instances: list[dict[str, Any]], class_name: str | None = None
    ) -> Predicted | RemoteError:
        """`class_name`: the parent request's class, which the handler's sub-calls take."""
        assert isinstance(self.service, CustomService)
        sub_calls: list[SubCall] = []
        try:
            predictions = await self.service.predict(instances, class_name, sub_calls)
        except Exception as e:  # noqa: BLE001
            return RemoteError.of(e)
        return Predicted(predictions, tuple(sub_calls))

    async def record_autoscaling_stats(self) -> dict[str, float]:
        batcher = self.service.batcher
        return {
            "num_running": float(batcher.num_running),
            "num_waiting": float(batcher.num_waiting),
        }

    async def info(self) -> dict[str, Any]:
        return {"node_id": _node_id(), "pid": os.getpid()}

    async def __del__(self) -> None:
        await self.service.shutdown(timeout_s=5.0)
