"""One shared server for the OpenAI-client, cancellation and metrics tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from ops_fleet import OPS_API_KEY, OPS_FLEET, OPS_STEP_DELAY_S
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
