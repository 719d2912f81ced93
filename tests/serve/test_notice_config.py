"""One NoticeConfig from the fleet file to the engine-core process: the fleet file's
`notice:` is cloud/notices.py's NoticeConfig itself (so its URL rule and Azure's
`resource_name` are the same on both sides), it crosses to the core process whole inside
EngineSpec, and a notice's `event_id` reaches the frontend."""

from __future__ import annotations

import time

import msgspec
import pytest
from metadata_standins import AzureScheduledEventsStandIn

from fleetserve.cloud.notices import NoticeConfig
from fleetserve.engine import core_proc
from fleetserve.engine.arg_utils import EngineArgs
from fleetserve.engine.wire import CoreMessage, CoreNotice, EngineSpec
from fleetserve.serve.config.fleet_config import parse_fleet_config

SPOT = {"name": "spot", "capacity": "spot", "replicas": 1}
BASE = {"name": "base", "capacity": "on_demand", "replicas": 1}


def fleet(notice: dict[str, object]) -> dict[str, object]:
    return {"models": [{"name": "chat", "pools": [{**SPOT, "notice": notice}, BASE]}]}


def test_the_fleet_file_sets_azure_resource_name() -> None:
    cfg = parse_fleet_config(fleet({"provider": "azure", "resource_name": "vm-7"}))
    pools = cfg.models[0].pools
    assert pools is not None
    assert pools[0].notice == NoticeConfig("azure", resource_name="vm-7")
    assert type(pools[0].notice) is NoticeConfig


@pytest.mark.parametrize(
    ("notice", "message"),
    [
        # The core process's rule, now the fleet file's: a base URL has no path (the
        # watcher appends the cloud's paths; a path used to pass here and fail there).
        ({"provider": "gcp", "url": "http://127.0.0.1:9000/x"}, "notice (model 'chat'): url"),
        ({"provider": "aws", "resource_name": "vm-1"}, "applies to provider 'azure' only"),
        ({"provider": "azure", "resource_name": ""}, "resource_name is a non-empty VM name"),
        ({"provider": "aws", "poll_interval_s": "1"}, "notice.poll_interval_s (model 'chat')"),
        ({"provider": "aws", "poll_interval_s": True}, "notice.poll_interval_s (model 'chat')"),
        ({"provider": "aws", "resource_name": 3}, "notice.resource_name (model 'chat')"),
    ],
)
def test_the_fleet_file_keeps_the_core_process_rules(
    notice: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError) as e:
        parse_fleet_config(fleet(notice), "fleet.yaml")
    assert str(e.value).startswith("fleet.yaml: models[0].pools[0].")
    assert message in str(e.value)


def test_engine_spec_carries_the_notice_and_engine_args_typed() -> None:
    notice = NoticeConfig("azure", url="http://127.0.0.1:9", poll_interval_s=0.5,
                          resource_name="vm-1")  # fmt: skip
    args = EngineArgs(model="/m", max_num_seqs=3, speculative_config={"method": "ngram"})
    spec = EngineSpec(args, "ipc://in", "ipc://out", 1, notice=notice)
    back = msgspec.json.decode(msgspec.json.encode(spec), type=EngineSpec)
    assert back.notice == notice and back.engine_args == args
    assert msgspec.json.decode(msgspec.json.encode(EngineSpec(args, "a", "b", 1)),
                               type=EngineSpec).notice is None  # fmt: skip


def test_a_notice_keeps_its_event_id_on_the_way_to_the_frontend() -> None:
    with AzureScheduledEventsStandIn() as azure:
        event_id = azure.preempt_in(30.0, ["vm-1"])
        cfg = NoticeConfig("azure", url=azure.url, poll_interval_s=0.05, resource_name="vm-1")
        watcher = core_proc._start_notice_watcher(cfg)
        assert watcher is not None
        try:
            deadline = time.monotonic() + 10.0
            taken: list[CoreNotice] = []
            while not taken and time.monotonic() < deadline:
                time.sleep(0.02)
                taken = core_proc._NOTICES.take()
        finally:
            watcher.stop()
    assert [n.event_id for n in taken] == [event_id]
    assert taken[0].source == "azure"
    # ... and the wire keeps it (the frontend decodes a CoreMessage).
    wire = msgspec.msgpack.encode(taken[0])
    decoded = msgspec.msgpack.decode(wire, type=CoreMessage)  # type: ignore[arg-type]
    assert isinstance(decoded, CoreNotice) and decoded.event_id == event_id
    core_proc._NOTICES.deadline = None
