"""Session-wide random checkpoints, built once per test session into a temp folder; how
pytest-xdist splits the suite over its workers."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from fleetserve.models.make_model import make_model
from helpers import freeze

# Under pytest-xdist (`make test` runs `-n 2 --dist loadfile`) a test module is one unit of
# work: its module-scoped servers start once, in one worker, and its tests keep their order.
# These modules share a session-scoped server of tests/server/conftest.py, so each group is
# one unit and its server starts once; the Ray modules (slow stage) are one unit, so that
# one Ray cluster runs at a time.
SHARED_UNITS = {
    "tests/server/test_fleet_server.py": "server",
    "tests/server/test_server_cancel.py": "server",
    "tests/server/test_server_metrics.py": "server",
    "tests/server/test_server_openai.py": "server",
    "tests/server/test_server_access_log.py": "ops_fleet",
    "tests/server/test_server_dashboard.py": "ops_fleet",
    **{
        path: "ray"
        for path in (
            "tests/server/test_server_ray.py",
            "tests/test_bench_chaos.py",
            "tests/test_lora_ray.py",
            "tests/test_ray_autoscale.py",
            "tests/test_ray_batch.py",
            "tests/test_ray_fleet.py",
            "tests/test_ray_pools_cluster.py",
            "tests/test_ray_resilience.py",
            "tests/test_ray_routing.py",
            "tests/test_ray_service_config.py",
        )
    },
}


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its module, or its module's group."""
    path = nodeid.split("::", 1)[0]
    return SHARED_UNITS.get(path, path)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """`--dist loadfile`, with the groups above as single units. (xdist's `loadgroup` would
    need marks, and its nodeid suffix does not take with this pytest.) Units go to the
    workers in collection order: the server tests, the longest, first."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

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
