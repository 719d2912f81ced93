"""`fleetserve batch run --ray` on a small local Ray (2 CPUs, 2 actors): chat, completion
and embedding files give the records a local `batch run` gives, and a run killed with
SIGKILL resumes on Ray to every line exactly once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fleetserve.entrypoints.cli import main
from ray_cluster import SRC_DIR, TESTS_DIR
from test_batch_cli import _req, _write, kill_once_committed

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    """A local Ray of 2 CPUs; the CLI joins it as another driver with --ray-address."""
    saved = dict(os.environ)
    # Its workers are processes of the raylet started here: they import fleetserve from
    # the same place as this process.
    paths = [SRC_DIR, TESTS_DIR, os.environ.get("PYTHONPATH", "")]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    ray.init(
        address="local",  # its own, even where another session's Ray runs
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=80 * 2**20,
        log_to_driver=False,
    )
    try:
        yield str(ray.get_runtime_context().gcs_address)
    finally:
        ray.shutdown()
        os.environ.clear()
        os.environ.update(saved)


def _fleet(tmp_path: Path, tiny_llama: str) -> str:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        "models:\n"
        f"  - {{name: chat, kind: generate, model: {json.dumps(tiny_llama)},"
        " engine: {max_num_seqs: 4}}\n"
        "  - {name: vec, kind: embed, batching: {max_batch_size: 4}}\n",
        encoding="utf-8",
    )
    return str(fleet)


def _ray_cmd(inp: Path, out: Path, address: str, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "fleetserve.entrypoints.cli", "batch", "run", str(inp),
        "-o", str(out), "--no-progress", "--ray", "--ray-address", address,
        "--ray-actors", "2", *extra,
    ]  # fmt: skip


def _run(cmd: list[str]) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC_DIR, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


def _comparable(path: Path) -> list[dict[str, Any]]:
    """The records without what is new on every run: ids and timestamps."""
    out = []
    for text in path.read_text(encoding="utf-8").splitlines():
        record = json.loads(text)
        del record["id"]
        if record["response"] is not None:
            del record["response"]["request_id"]
            record["response"]["body"].pop("id", None)
            record["response"]["body"].pop("created", None)
        out.append(record)
    return out


def _vectors(records: list[dict[str, Any]]) -> list[Any]:
    """Embedding lines' vectors, taken out of the records (compared with a tolerance)."""
    vectors = []
    for r in records:
        data = r["response"]["body"].get("data") if r["response"] else None
        vectors.append(np.array([d.pop("embedding") for d in data]) if data else None)
    return vectors


def test_ray_run_writes_what_the_local_run_writes(
    tiny_llama: str, tmp_path: Path, ray_address: str
) -> None:
    greedy = {"temperature": 0, "ignore_eos": True}
    chat = [
        _req(f"c{i}", CHAT, {"messages": [{"role": "user", "content": f"tell me about {i}"}],
                             "max_tokens": 6, **greedy})
        for i in range(10)
    ]  # fmt: skip
    chat += [
        "{broken",
        _req("bad-top-p", CHAT, {"messages": [{"role": "user", "content": "x"}], "top_p": 2}),
        _req("unknown", CHAT, {"messages": [{"role": "user", "content": "x"}], "model": "gpt"}),
        _req("wrong-kind", CHAT, {"messages": [{"role": "user", "content": "x"}], "model": "vec"}),
    ]
    cmpl = [
        _req(f"p{i}", COMPLETIONS, {"prompt": f"{i} {i * 7} {i * 13} and", "max_tokens": 5,
                                    "model": "chat", **greedy})
        for i in range(10)
    ]  # fmt: skip
    cmpl.append(_req("two", COMPLETIONS, {"prompt": ["a b", "c d e"], "max_tokens": 4, **greedy}))
    emb = [_req(f"e{i}", EMBEDDINGS, {"input": [f"sentence {i}", f"and {i * 3} more"],
                                      "model": "vec"})
           for i in range(6)]  # fmt: skip
    emb.append(_req("empty", EMBEDDINGS, {"input": [""], "model": "vec"}))
    fleet = _fleet(tmp_path, tiny_llama)
    for name, lines in (("chat", chat), ("cmpl", cmpl), ("emb", emb)):
        inp = tmp_path / f"{name}.jsonl"
        _write(inp, lines)
        local, on_ray = tmp_path / f"{name}.local.jsonl", tmp_path / f"{name}.ray.jsonl"
        assert main(["batch", "run", str(inp), "-o", str(local), "--config", fleet,
                     "--no-progress"]) == 0  # fmt: skip
        stderr = _run(_ray_cmd(inp, on_ray, ray_address, "--config", fleet, "--concurrency", "3"))
        assert "2 Ray actors of 3 lines a call" in stderr
        want, got = _comparable(local), _comparable(on_ray)
        for w, g in zip(_vectors(want), _vectors(got), strict=True):
            assert (w is None) == (g is None)
            if w is not None:
                np.testing.assert_allclose(g, w, atol=1e-5)
        assert got == want, name
        ok = [r for r in got if r["error"] is None]
        assert len(ok) == {"chat": 10, "cmpl": 11, "emb": 6}[name]
        if name == "cmpl":  # different prompts, different texts: the comparison can fail
            assert len({r["response"]["body"]["choices"][0]["text"] for r in ok}) > 5


def _no_torch(driver_pid: int) -> None:
    """The driver only reads, routes and writes lines: the engines (and torch) live in
    the Ray actors."""
    with open(f"/proc/{driver_pid}/maps") as f:
        assert "libtorch" not in f.read()


def test_sigkill_mid_ray_run_then_rerun_is_exactly_once(
    tiny_llama: str, tmp_path: Path, ray_address: str
) -> None:
    n = 40
    lines = [
        _req(f"id-{i}", COMPLETIONS, {"prompt": f"count {i} to", "max_tokens": 24,
                                      "ignore_eos": True, "temperature": 0})
        for i in range(n)
    ]  # fmt: skip
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, lines)
    ckpt = Path(f"{out}.ckpt")
    cmd = _ray_cmd(inp, out, ray_address, "--model", tiny_llama, "--max-num-seqs", "2",
                   "--concurrency", "2")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC_DIR, os.environ.get("PYTHONPATH", "")])}
    # Its own session, so that SIGKILL takes the whole driver (a preempted node).
    before = kill_once_committed(cmd, ckpt, 4, timeout_s=300, env=env, running=_no_torch)
    assert 4 <= len(before) < n, "the run must be killed mid-way"
    assert not out.exists()

    stderr = _run(cmd)
    assert f"ran {n - len(before)} lines" in stderr  # only the lines not committed yet
    assert f"{n} lines ({n} ok, 0 failed)" in stderr
    got = out.read_text(encoding="utf-8").splitlines()
    assert [json.loads(g)["custom_id"] for g in got] == [f"id-{i}" for i in range(n)]
    by_id = {json.loads(g)["custom_id"]: g for g in got}
    assert all(by_id[cid] == rec for cid, rec in before.items())
