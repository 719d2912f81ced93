"""One shared server for the OpenAI-client, cancellation and metrics tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from server_proc import ServerProc


@pytest.fixture(scope="session")
def server(tiny_llama: str) -> Iterator[ServerProc]:
    srv = ServerProc(tiny_llama, "--served-model-name", "tiny", "--max-num-seqs", "64")
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()
