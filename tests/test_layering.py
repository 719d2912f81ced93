"""The package layers (docs/architecture.md's layers map), checked on the source's imports,
the lazy ones inside functions included: the engine imports nothing of the fleet, and no
chain of imports leads from a Ray module through the HTTP layer back into Ray."""

from __future__ import annotations

import ast
from pathlib import Path

import fleetserve

ROOT = Path(fleetserve.__file__).parent


def _module(path: Path) -> str:
    parts = ["fleetserve", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """module -> the fleetserve modules it imports (anywhere in its body)."""
    modules = {_module(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            found.update(t for t in targets if t in modules and t != name)
        graph[name] = found
    return graph


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_the_engine_imports_nothing_of_the_fleet() -> None:
    graph = _imports()
    fleet = ("fleetserve.serve", "fleetserve.ray", "fleetserve.entrypoints", "fleetserve.deploy")
    for name in graph:
        if name.startswith(("fleetserve.engine", "fleetserve.core", "fleetserve.cloud")):
            wrong = sorted(m for m in graph[name] if m.startswith(fleet))
            assert not wrong, f"{name} imports {wrong}"


def test_no_import_cycle_between_the_http_layer_and_ray() -> None:
    graph = _imports()
    for name in graph:
        if name.startswith("fleetserve.ray"):
            back = sorted(
                m
                for m in _reachable(graph, name)
                if m.startswith("fleetserve.entrypoints") and name in _reachable(graph, m)
            )
            assert not back, f"{name} -> {back} -> {name}"


def test_the_check_sees_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"a"}, "c": set()}
    assert "a" in _reachable(graph, "a") and "c" not in _reachable(graph, "a")
