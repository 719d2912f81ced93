"""Per-adapter Prometheus series (label `lora_name`), on the server's registry.

Requests and tokens are counted by the frontend (AsyncEngine) as they are sent and come
back; loads and evictions are the engine cores' running totals (WireLoRAState), turned
into counter increments per replica the way ModelMetrics does for the engine's totals.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from fleetserve.metrics import ModelMetrics, ServerMetrics


class _Families:
    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["model_name", "lora_name"]
        self.requests = Counter(
            "fleetserve:lora_requests", "Requests sent to an engine, per LoRA adapter.",
            labels, registry=registry,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "fleetserve:lora_prompt_tokens", "Prompt tokens of requests per LoRA adapter.",
            labels, registry=registry,
        )  # fmt: skip
        self.generation_tokens = Counter(
            "fleetserve:lora_generation_tokens", "Tokens generated per LoRA adapter.",
            labels, registry=registry,
        )  # fmt: skip
        self.loads = Counter(
            "fleetserve:lora_loads", "Adapter loads from disk into an engine's memory.",
            labels, registry=registry,
        )  # fmt: skip
        self.evictions = Counter(
            "fleetserve:lora_evictions",
            "Adapters an engine dropped from memory (least recently used past max_cpu_loras).",
            labels, registry=registry,
        )  # fmt: skip


_FAMILIES: dict[int, _Families] = {}


def _families(server: ServerMetrics) -> _Families:
    key = id(server.registry)
    if key not in _FAMILIES:
        _FAMILIES[key] = _Families(server.registry)
    return _FAMILIES[key]


class LoRAMetrics:
    """One model's per-adapter series."""

    def __init__(self, metrics: ModelMetrics) -> None:
        self.model_name = metrics.model_name
        self._f = _families(metrics.server)
        self._last: dict[tuple[int, str, str], int] = {}

    def add_request(self, lora_name: str, num_prompt_tokens: int) -> None:
        self._f.requests.labels(self.model_name, lora_name).inc()
        self._f.prompt_tokens.labels(self.model_name, lora_name).inc(num_prompt_tokens)

    def add_generation_tokens(self, lora_name: str, num_tokens: int) -> None:
        if num_tokens:
            self._f.generation_tokens.labels(self.model_name, lora_name).inc(num_tokens)

    def set_engine_totals(
        self, replica: int, loads: dict[str, int], evictions: dict[str, int]
    ) -> None:
        for kind, totals, family in (
            ("loads", loads, self._f.loads),
            ("evictions", evictions, self._f.evictions),
        ):
            for name, total in totals.items():
                key = (replica, kind, name)
                delta = total - self._last.get(key, 0)
                if delta > 0:
                    family.labels(self.model_name, name).inc(delta)
                self._last[key] = total
