"""Every example fleet file of the README and docs, through `fleetserve deploy k8s`: each
rendered Deployment's own command runs, as a process on 127.0.0.1, on its mounted
ConfigMap, and becomes ready (its readiness probe's path answers 200). A fleet file that
`deploy k8s` cannot turn into pods that start is refused with the path of the key.

The examples are read from the Markdown itself (every fenced block that parses as a fleet
file, or as a list of model entries: a fragment of one), so a new example is covered
without touching this test. Only what does not exist on this machine is stood in for: a
model file the example names (`/models/chat.gguf`) becomes a tiny random checkpoint, a
custom handler module (`mypkg.vision`) a test handler that takes any options, a remote
model's pods a server the test starts on that model, and the pod's emptyDir cache is this
machine's kernel cache (an image with its kernels built)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from server_proc import ServerProc
from test_deploy_prometheus import pod_args

from fleetserve.deploy import pods
from fleetserve.deploy.k8s import RenderOptions, render_fleet
from fleetserve.engine.embedding import MINILM_NAME
from fleetserve.serve.config.fleet_config import parse_fleet_config

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
_FENCE = re.compile(r"^```[\w-]*\n(.*?)^```", re.S | re.M)


@dataclass(frozen=True)
class Example:
    where: str  # file:line
    fleet: dict[str, Any]


def examples() -> list[Example]:
    out = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text(encoding="utf-8")
        for m in _FENCE.finditer(text):
            try:
                data = yaml.safe_load(m.group(1))
            except yaml.YAMLError:
                continue
            if (
                isinstance(data, list)
                and data
                and all(isinstance(e, dict) and "name" in e for e in data)
            ):
                data = {"models": data}  # a fragment: model entries
            if isinstance(data, dict) and isinstance(data.get("models"), list):
                line = text[: m.start()].count("\n") + 1
                out.append(Example(f"{doc.relative_to(ROOT)}:{line}", data))
    return out


EXAMPLES = examples()


def test_the_docs_have_examples() -> None:
    # The README's fleet, pools, deploy, gateway and Ray fragments at least.
    assert len([e for e in EXAMPLES if e.where.startswith("README")]) >= 5


def _stand_ins(fleet: dict[str, Any], tiny: str) -> dict[str, Any]:
    fleet = yaml.safe_load(yaml.safe_dump(fleet))
    for entry in fleet["models"]:
        path = entry.get("model")
        if path is not None and path != MINILM_NAME and not os.path.exists(path):
            entry["model"] = tiny
        if entry.get("kind") == "custom":
            module = entry["handler"].partition(":")[0]
            if not (TESTS / f"{module}.py").exists():
                entry["handler"] = "fleet_handlers:AnyOptions"
    return fleet


@dataclass
class Pod:
    server: ServerProc
    container: dict[str, Any]


def _start_pod(deployment: dict[str, Any], config_map: dict[str, Any], tmp: Path) -> Pod:
    spec = deployment["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    config_dir = tmp / deployment["metadata"]["name"]
    config_dir.mkdir()
    for mount in container["volumeMounts"]:
        volume = volumes[mount["name"]]
        if "configMap" in volume:
            assert volume["configMap"]["name"] == config_map["metadata"]["name"]
            assert mount["mountPath"] == pods.CONFIG_DIR
            for name, text in config_map["data"].items():
                (config_dir / name).write_text(text, encoding="utf-8")
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    env.pop("FLEETSERVE_CACHE")  # the emptyDir: this machine's built kernels instead
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    config = str(config_dir / pods.CONFIG_FILE)
    server = ServerProc(None, *pod_args(container, config), env=env)
    return Pod(server, container)


def _rendered(fleet: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(Deployment, ConfigMap) per model of the fleet."""
    objs = [m.obj for m in render_fleet(parse_fleet_config(fleet), RenderOptions())]
    maps = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ConfigMap"}
    out = []
    for o in objs:
        if o["kind"] == "Deployment":
            (volume,) = [v for v in o["spec"]["template"]["spec"]["volumes"] if "configMap" in v]
            out.append((o, maps[volume["configMap"]["name"]]))
    return out


@pytest.fixture(scope="module")
def backends(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServerProc]]:
    started: list[ServerProc] = []
    yield started
    for s in started:
        s.stop()


def _point_remotes_here(
    fleet: dict[str, Any], backends: list[ServerProc], folder: Path
) -> dict[str, Any]:
    """A remote model's pods: a server of that model (the entry without `remote`)."""
    for entry in fleet["models"]:
        remote = entry.get("remote")
        if remote is None:
            continue
        own = {k: v for k, v in entry.items() if k != "remote"}
        path = folder / f"backend-{len(backends)}.yaml"
        path.write_text(yaml.safe_dump({"models": [own]}), encoding="utf-8")
        server = ServerProc(None, "--config", str(path))
        backends.append(server)
        server.wait_ready()
        remote.pop("dns", None)
        remote["urls"] = [server.url]
        remote.pop("api_key_env", None)  # the stand-in pod has no key
    return fleet


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.where for e in EXAMPLES])
def test_rendered_pods_start(
    example: Example,
    tiny_model_factory: Callable[..., str],
    backends: list[ServerProc],
    tmp_path: Path,
) -> None:
    fleet = _stand_ins(example.fleet, tiny_model_factory("llama"))
    parsed = parse_fleet_config(fleet)
    try:
        rendered = _rendered(fleet)
    except ValueError as e:
        # Refused: the message leads with the key's path, a key the example sets.
        m = re.match(r"models\[(\d+)\]\.(\w+)", str(e))
        assert m is not None, str(e)
        entry = fleet["models"][int(m[1])]
        assert m[2] in entry, (str(e), entry)
        assert getattr(parsed.models[int(m[1])], m[2]) is not None
        return
    fleet = _point_remotes_here(fleet, backends, tmp_path)
    rendered = _rendered(fleet)
    assert len(rendered) == len(fleet["models"])
    started = [_start_pod(d, c, tmp_path) for d, c in rendered]
    try:
        for pod in started:
            pod.server.wait_ready()
            probe = pod.container["readinessProbe"]["httpGet"]["path"]
            assert httpx.get(pod.server.url + probe, timeout=10).status_code == 200
            assert httpx.get(pod.server.url + "/health", timeout=10).status_code == 200
    finally:
        for pod in started:
            pod.server.stop()
