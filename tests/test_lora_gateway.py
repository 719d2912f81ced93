"""The gateway knows which pods hold which adapters: a pod's load report lists its engines'
adapters (entrypoints/openai/replica_api.py), the gateway's RemoteEngine takes them as
its `lora_loaded`, and adapter-aware routing (serve/routing/adapters.py) prefers those
pods, as it does for local engine processes."""

from __future__ import annotations

import msgspec

from fleetserve.core.lora_request import LoRARequest
from fleetserve.engine.arg_utils import EngineArgs
from fleetserve.serve.contracts import RouteRequest
from fleetserve.serve.remote.replica import RemoteEngine
from fleetserve.serve.remote.wire import LoadReport
from fleetserve.serve.replicas.local import LocalReplica
from fleetserve.serve.routing.adapters import adapter_candidates

_REPORT = {
    "model": "tiny", "healthy": True, "draining": False, "drain_left_s": None,
    "dead_reason": None, "num_replicas": 1, "num_outstanding_requests": 0,
    "num_outstanding_tokens": 0, "queue_depth": 0, "num_requests_running": 0,
    "kv_cache_usage_perc": 0.0, "kv_capacity_tokens": None, "max_num_seqs": 4,
    "step_latency_s": None, "num_steps": 0, "prefix_cache_hit_rate": 0.0,
}  # fmt: skip


def test_a_report_without_adapters_decodes_to_none() -> None:
    """An older pod's report (no lora_adapters field) still decodes."""
    report = msgspec.json.decode(msgspec.json.encode(_REPORT), type=LoadReport)
    assert report.lora_adapters == []


def test_the_gateway_routes_an_adapter_to_the_pod_holding_it(tiny_llama: str) -> None:
    config, _ = EngineArgs(model=tiny_llama).resolve()
    replicas = []
    for i, held in enumerate(([], ["a"])):
        engine = RemoteEngine(f"http://127.0.0.1:{9 + i}", "tiny", config)
        report = {**_REPORT, "lora_adapters": held}
        engine._apply(msgspec.json.decode(msgspec.json.encode(report), type=LoadReport))
        replicas.append(LocalReplica(i, engine, max_num_seqs=4))  # type: ignore[arg-type]
    assert replicas[1].lora_names == frozenset({"a"})
    assert replicas[0].lora_names == frozenset()
    request = RouteRequest("r", (1, 2, 3), 8, lora_name=LoRARequest("a", 1, "/a").lora_name)
    assert adapter_candidates(request, replicas, 2048) == [replicas[1]]
    # The pod reports it dropped the adapter: no longer preferred.
    replicas[1].engine._apply(  # type: ignore[attr-defined]
        msgspec.json.decode(msgspec.json.encode(_REPORT), type=LoadReport)
    )
    assert replicas[1].lora_names == frozenset()
