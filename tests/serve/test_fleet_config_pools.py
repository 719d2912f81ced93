"""The fleet file's pool keys: spot and on-demand pools, notice sources, classes pinned to
spot. Every rule is refused with the key's path before anything loads."""

from __future__ import annotations

import pytest

from fleetserve.serve.config.fleet_config import NoticeConfig, PoolConfig, parse_fleet_config

SPOT = {"name": "spot", "capacity": "spot", "replicas": 3, "overprovision": 1}
BASE = {"name": "base", "capacity": "on_demand", "replicas": 1, "max_fallback": 3}


def one(**model: object) -> dict[str, object]:
    return {"models": [{"name": "chat", **model}]}


def test_pools_parse_and_plan() -> None:
    notice = {"provider": "gcp", "url": "http://127.0.0.1:9000", "poll_interval_s": 0.5}
    cfg = parse_fleet_config(
        {
            "models": [
                {"name": "chat", "pools": [{**SPOT, "notice": notice}, BASE]},
                # Embed and custom models batch in the API process: no spot capacity to pin
                # them to, so a spot-pinned class does not ask them for a spot pool.
                {"name": "e", "kind": "embed"},
            ],
            "classes": {"interactive": {}, "batch": {"priority": 10, "capacity": "spot"}},
            "default_class": "interactive",
        }
    )
    chat, embed = cfg.models
    plain = parse_fleet_config(one(replicas=2)).models[0]
    spot, base = chat.replica_plan()
    assert (spot.name, spot.capacity, spot.replicas, spot.overprovision) == ("spot", "spot", 3, 1)
    assert spot.notice == NoticeConfig(provider="gcp", url="http://127.0.0.1:9000",
                                       poll_interval_s=0.5)  # fmt: skip
    assert (base.capacity, base.replicas, base.max_fallback, base.notice) == (
        "on_demand", 1, 3, None)  # fmt: skip
    assert chat.has_spot and not plain.has_spot and not embed.has_spot
    # Without pools the rest of the code still sees one: on-demand, named "default".
    assert plain.replica_plan() == [PoolConfig(name="default", capacity="on_demand", replicas=2)]
    assert cfg.classes["interactive"].capacity == "any"
    assert cfg.spot_only_classes() == frozenset({"batch"})


def test_notice_defaults() -> None:
    cfg = parse_fleet_config(one(pools=[{**SPOT, "notice": {"provider": "azure"}}, BASE]))
    pools = cfg.models[0].pools
    assert pools is not None and pools[0].notice == NoticeConfig(
        provider="azure", url=None, poll_interval_s=1.0
    )


def test_spot_with_base_only_and_fallback_only_pools() -> None:
    # Base on-demand without dynamic fallback (SkyServe's base_ondemand_fallback_replicas
    # alone), and dynamic fallback without a base: both are something to fall back on.
    for od in ({**BASE, "max_fallback": 0}, {**BASE, "replicas": 0}):
        cfg = parse_fleet_config(one(pools=[SPOT, od]))
        assert len(cfg.models[0].replica_plan()) == 2
    # On-demand pools alone need no spot.
    cfg = parse_fleet_config(one(pools=[{**BASE, "max_fallback": 0}]))
    assert not cfg.models[0].has_spot


P = "models[0].pools"
M = "models[0] (model 'chat')"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (one(pools=[]), f"{P} (model 'chat'): List should have at least 1 item"),
        (one(pools=[SPOT, {**BASE, "name": "spot"}]),
         f"{P} (model 'chat'): pool names must be unique; repeated: spot"),
        (one(pools=[{**SPOT, "name": "my spot"}, BASE]), f"{P}[0] (model 'chat'): name 'my spot'"),
        (one(pools=[{**BASE, "replicas": 0}]), "the pools' replicas add up to 0"),
        (one(pools=[SPOT]), f"{P} (model 'chat'): spot pools need an on_demand pool"),
        (one(pools=[SPOT, {**BASE, "replicas": 0, "max_fallback": 0}]),
         "spot pools need an on_demand pool to fall back on"),
        (one(pools=[{**SPOT, "replicas": 40}, {**BASE, "max_fallback": 30}]),
         f"{P} (model 'chat'): replicas + overprovision + max_fallback add up to 72; at most 64"),
        (one(pools=[SPOT, {**BASE, "overprovision": 1}]),
         f"{P}[1] (model 'chat'): overprovision is for spot pools"),
        (one(pools=[{**SPOT, "max_fallback": 1}, BASE]),
         f"{P}[0] (model 'chat'): max_fallback is for on_demand pools"),
        (one(pools=[SPOT, {**BASE, "notice": {"provider": "aws"}}]),
         f"{P}[1] (model 'chat'): notice is for spot pools"),
        (one(pools=[{**SPOT, "capacity": "reserved"}, BASE]),
         f"{P}[0].capacity (model 'chat'): Input should be 'spot' or 'on_demand'"),
        (one(pools=[{**SPOT, "replicas": -1}, BASE]),
         f"{P}[0].replicas (model 'chat'): Input should be greater than or equal to 0"),
        (one(pools=[{**SPOT, "overprovision": -1}, BASE]), f"{P}[0].overprovision (model"),
        (one(pools=[SPOT, {**BASE, "max_fallback": -2}]), f"{P}[1].max_fallback (model"),
        (one(pools=[{"name": "x", "capacity": "on_demand"}]),
         f"{P}[0].replicas (model 'chat'): Field required"),
        (one(pools=[{**BASE, "size": 2}]), f"{P}[0].size (model 'chat'): Extra inputs"),
        (one(pools=[{**SPOT, "notice": {"provider": "ibm"}}, BASE]),
         f"{P}[0].notice.provider (model 'chat'): Input should be 'aws', 'gcp' or 'azure'"),
        (one(pools=[{**SPOT, "notice": {"provider": "aws", "poll_interval_s": 0}}, BASE]),
         f"{P}[0].notice.poll_interval_s (model 'chat'): Input should be greater than 0"),
        (one(pools=[{**SPOT, "notice": {"provider": "aws", "url": "169.254.169.254"}}, BASE]),
         f"{P}[0].notice (model 'chat'): url '169.254.169.254': expected http://host"),
        (one(pools=[{**SPOT, "notice": {"provider": "aws", "every": 1}}, BASE]),
         f"{P}[0].notice.every (model 'chat'): Extra inputs"),
        (one(pools=[BASE], replicas=2), f"{M}: give replicas or pools, not both"),
        (one(pools=[BASE], autoscale={"min_replicas": 1}), f"{M}: give autoscale or pools"),
        (one(pools=[BASE], kind="embed"), f"{M}: pools is for generate models, not 'embed'"),
        ({**one(), "classes": {"a": {"capacity": "on_demand"}}},
         "classes.a.capacity: Input should be 'any' or 'spot'"),
        ({"models": [{"name": "chat", "pools": [SPOT, BASE]}, {"name": "plain"}],
          "classes": {"batch": {"capacity": "spot"}}},
         "classes.batch.capacity is 'spot' but models[1] ('plain') has no spot pool"),
    ],
)  # fmt: skip
def test_errors_name_the_key(data: object, message: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_fleet_config(data, "fleet.yaml")
    assert str(e.value).startswith("fleet.yaml: ")
    assert message in str(e.value)
