"""A `remote:` model's gateway refuses what only its pods can do (nothing is accepted and
ignored), and `deploy k8s --gateway` leaves those keys to the pods' fleet file."""

from __future__ import annotations

import pytest

from fleetserve.deploy.gateway import gateway_fleet_file
from fleetserve.serve.config.fleet_config import parse_fleet_config

REMOTE = {"name": "m", "remote": {"urls": ["http://127.0.0.1:8001"]}}


@pytest.mark.parametrize(
    ("resilience", "keys"),
    [
        ({"sigterm_grace_s": 5.0}, "resilience.sigterm_grace_s"),
        ({"replace_failed": False}, "resilience.replace_failed"),
        ({"replace_failed": True, "sigterm_grace_s": 5.0},
         "resilience.sigterm_grace_s, resilience.replace_failed"),
    ],
)  # fmt: skip
def test_remote_refuses_what_its_pods_do(resilience: dict[str, object], keys: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_fleet_config({"models": [{**REMOTE, "resilience": resilience}]}, "gw.yaml")
    assert f"gw.yaml: models[0] (model 'm'): {keys}: a remote model's pods" in str(e.value)


def test_remote_keeps_the_gateways_own_resilience() -> None:
    resilience = {"migration_limit": 5, "migration_wait_s": 2.0, "hang_timeout_s": 9.0}
    fleet = parse_fleet_config({"models": [{**REMOTE, "resilience": resilience}]})
    got = fleet.models[0].resilience
    assert (got.migration_limit, got.migration_wait_s, got.hang_timeout_s) == (5, 2.0, 9.0)
    # The same keys on a local model are its own engines' settings.
    local = {"name": "m", "resilience": {"sigterm_grace_s": 5.0, "replace_failed": False}}
    assert parse_fleet_config({"models": [local]}).models[0].resilience.sigterm_grace_s == 5.0


def test_the_gateway_file_leaves_pod_settings_to_the_pods() -> None:
    resilience = {"sigterm_grace_s": 5.0, "replace_failed": False, "migration_limit": 2}
    fleet = parse_fleet_config({"models": [{"name": "m", "resilience": resilience}]})
    data = gateway_fleet_file(fleet, {"m": "m"}, "ns", 8000, api_key=False)
    assert data["models"][0]["resilience"] == {"migration_limit": 2}
    gateway = parse_fleet_config(data)  # and the gateway takes its own file
    assert gateway.models[0].remote is not None
    assert gateway.models[0].resilience.migration_limit == 2
