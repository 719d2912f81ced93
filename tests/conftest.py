"""Session-wide random checkpoints, built once per test session into a temp folder; how
pytest-xdist splits the suite over its workers."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from fleetserve.models.make_model import make_model
from helpers import freeze

# `--dtype auto` picks bf16 weights on CPUs with native bf16 (engine/dtype_choice.py). The
# suite's references are float32 (HF float32 token parity, TP/PP ranks against one
# process, float32 logprob tolerances), so auto keeps float32 here unless the run sets
# FLEETSERVE_AUTO_BF16=1; server subprocesses inherit it. The bf16 choice and the bf16
# path have their own tests (test_dtype_choice.py, test_bf16_weights.py,
# test_bf16_hf_parity.py).
os.environ.setdefault("FLEETSERVE_AUTO_BF16", "0")
# The engines here serve a few short requests from KV caches sized for a server: their
# pages are left to the first writes (the cache is zero either way; kernels/cpu.py).
os.environ.setdefault("FLEETSERVE_KV_PREFAULT", "0")
# Ray turns token authentication on for a process at its first local `ray.init()` (the
# `ray_local` unit) and keeps it in that process's cached config after the fixture restores
# os.environ; a simulated cluster started later by the same worker (tests/ray_cluster.py)
# then runs without tokens, and its workers' calls into this process are refused: actors it
# owns die at creation, a driver-side deployment handle never hears from the replica
# ("Timed out resolving to ObjectRef"). One mode for the session keeps every driver and
# cluster in agreement (test_ray_auth_mode.py); its clusters are this machine's own.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

# Under pytest-xdist (`make test` runs `-n 2 --dist loadfile`) a test module is one unit of
# work: its module-scoped servers start once, in one worker, and its tests keep their order.
# These modules share a session-scoped server of tests/server/conftest.py, so each group is
# one unit and its server starts once. The Ray modules (slow stage) each start a cluster of
# their own with ports of its own (tests/ray_cluster.py), so two run side by side; those
# that start a plain local Ray (`ray.init(address="local")`: `serve --ray`, the Ray Serve
# baseline of `bench chaos`, `batch run --ray`) are one unit, as such heads share default
# ports.
SHARED_UNITS = {
    "tests/server/test_fleet_server.py": "server",
    "tests/server/test_server_cancel.py": "server",
    "tests/server/test_server_metrics.py": "server",
    "tests/server/test_server_openai.py": "server",
    "tests/server/test_server_deadline.py": "server",
    "tests/server/test_server_cascade.py": "pipeline_fleet",
    "tests/server/test_server_fleet_client.py": "pipeline_fleet",
    "tests/server/test_server_graph.py": "pipeline_fleet",
    "tests/server/test_server_handlers.py": "pipeline_fleet",
    "tests/server/test_server_access_log.py": "ops_fleet",
    "tests/server/test_server_dashboard.py": "ops_fleet",
    "tests/server/test_server_ray.py": "ray_local",
    "tests/test_bench_chaos.py": "ray_local",
    "tests/test_ray_batch.py": "ray_local",
    "tests/test_ray_auth_mode.py": "ray_local",
}


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its module, or its module's group."""
    path = nodeid.split("::", 1)[0]
    return SHARED_UNITS.get(path, path)


# A worker that runs out of work takes the costliest unit left (longest processing time
# first), so the long units start at once and the short ones fill the gaps at the end: with
# `--dist loadfile` the last long unit to start bounds the wall time. A unit's cost is
# DEFAULT_TEST_S per test plus the seconds of its known slow phases below (from the
# `--durations` lists of two-worker `make test` runs, 2026-12-05; relative figures, only the
# order matters). Add a unit here when `--durations` shows a new slow phase. The fast
# stage's non-server units below: each module's phases in the 09:20 list (load 3-5).
SLOW_PHASES_S: dict[str, float] = {
    "server": 60.0,  # four modules on one session server: the order before put it first
    "tests/serve/test_pool_service.py": 45.0,  # engine processes killed and replaced
    "tests/test_batch_cli.py": 57.0,  # 71 s before its runs moved into the test process
    "tests/test_moe_parallel.py": 56.0,  # TP/EP ranks per case
    "tests/server/test_gateway.py": 55.0,  # 3 pods + 2 gateways at once, scale from zero
    "tests/serve/test_resume.py": 45.0,
    "pipeline_fleet": 40.0,  # four modules on one session fleet of 4 engines + handlers
    "tests/test_data_parallel.py": 38.0,
    "tests/test_structured_engine.py": 30.0,  # SmolLM2 fixture, fused mask 10 s
    "tests/test_spec_decode.py": 30.0,  # SmolLM2 draft/target
    "tests/server/test_chaos.py": 30.0,  # dp=2 server, reference at once, 4 chaos runs
    "tests/test_attention_kernel.py": 21.0,  # the kernels compiled into a fresh cache
    "tests/server/test_server_batch.py": 20.0,  # kill -9 mid batch
    "tests/test_loader.py": 20.0,  # SmolLM2 against HF
    "tests/test_bench_serve.py": 20.0,
    "tests/test_fused_decode.py": 15.0,  # Gemma 3 270M GGUF
    # The slow stage (`--durations` of `-m slow`, 2026-12-05 13:36, quiet; the Ray modules
    # that slowray cut since, by its per-module runs): the Ray modules first, each on its
    # own cluster.
    "ray_local": 171.0,
    "tests/test_lora_ray.py": 95.0,
    "tests/test_ray_fleet.py": 90.0,
    "tests/test_ray_resilience.py": 84.0,
    "tests/test_ray_pools_cluster.py": 56.0,
    "tests/test_pipelines_ray.py": 66.0,
    "tests/test_ray_autoscale.py": 40.0,
    "tests/test_ray_service_config.py": 74.0,
    "tests/server/test_deploy_examples.py": 48.0,
    "tests/server/test_server_fuzz.py": 38.0,
    "tests/test_ray_routing.py": 30.0,
    "tests/test_parallel.py": 34.0,
    "tests/server/test_two_model_fleet.py": 29.0,
}
DEFAULT_TEST_S = 0.5


def unit_cost(unit: str, num_tests: int) -> float:
    return SLOW_PHASES_S.get(unit, 0.0) + DEFAULT_TEST_S * num_tests


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """`--dist loadfile`, with the groups above as single units. (xdist's `loadgroup` would
    need marks, and its nodeid suffix does not take with this pytest.) Units go to the
    workers costliest first (unit_cost)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

        def _assign_work_unit(self, node: object) -> None:
            # xdist hands out the queue's first unit: put the costliest one there.
            queue = self.workqueue
            if queue:
                top = max(queue, key=lambda unit: unit_cost(unit, len(queue[unit])))
                queue.move_to_end(top, last=False)
            super()._assign_work_unit(node)  # type: ignore[arg-type]

    config.option.loadscopereorder = False
    return ModuleUnits(config, log)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """`factory(arch, **overrides) -> checkpoint folder`, cached by its arguments.

    `overrides` go to `make_model`: config fields, `seed`, `max_shard_size`.
    """
    root = tmp_path_factory.mktemp("tiny-models")
    built: dict[tuple, str] = {}

    def factory(arch: str = "llama", **overrides: object) -> str:
        key = (arch, freeze(overrides))
        if key not in built:
            out = root / f"{arch}-{len(built)}"
            built[key] = make_model(str(out), arch, "tiny", **overrides)
        return built[key]

    return factory


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory: Callable[..., str]) -> str:
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def tiny_mistral(tiny_model_factory: Callable[..., str]) -> str:
    return tiny_model_factory("mistral")


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_model_factory: Callable[..., str]) -> str:
    return tiny_model_factory("qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_model_factory: Callable[..., str]) -> str:
    return tiny_model_factory("qwen3")
