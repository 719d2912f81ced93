"""Servers shared by several test modules, each started once per session: a plain one (the
OpenAI-client, cancellation, metrics and deadline tests), the operations fleet (access log,
dashboard) and the pipeline fleet (graphs, cascades, custom handlers and their sub-calls).
tests/conftest.py SHARED_UNITS puts the modules of each in one xdist unit."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from ops_fleet import OPS_API_KEY, OPS_FLEET, OPS_STEP_DELAY_S
from pipeline_fleet import PIPELINE_STEP_DELAY_S, pipeline_fleet_config
from server_proc import ServerProc


@pytest.fixture(scope="session")
def server(tiny_llama: str) -> Iterator[ServerProc]:
    srv = ServerProc(tiny_llama, "--served-model-name", "tiny", "--max-num-seqs", "64")
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def ops_fleet(
    tiny_llama: str, tiny_qwen2: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProc]:
    path = tmp_path_factory.mktemp("ops-fleet") / "fleet.yaml"
    path.write_text(OPS_FLEET.format(llama=tiny_llama, qwen2=tiny_qwen2))
    srv = ServerProc(
        None,
        "--config",
        str(path),
        env={"FLEETSERVE_API_KEY": OPS_API_KEY, "FLEETSERVE_DEBUG_STEP_DELAY_S": OPS_STEP_DELAY_S},
    )
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def pipeline_fleet(
    tiny_model_factory: Callable[..., str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProc]:
    config = pipeline_fleet_config(tiny_model_factory("llama"), tiny_model_factory("llama", seed=7))
    env = {"FLEETSERVE_DEBUG_STEP_DELAY_S": PIPELINE_STEP_DELAY_S}
    srv = ServerProc.fleet(config, tmp_path_factory.mktemp("pipeline-fleet"), env)
    try:
        yield srv.wait_ready()
    finally:
        assert srv.stop() == 0, srv.final_output
