"""`fleetserve batch run` on a real tiny engine: answers equal the offline LLM's, bad lines
become error lines, and a run killed with SIGKILL resumes to exactly-once output."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fleetserve.core.sampling_params import SamplingParams
from fleetserve.engine.llm import LLM
from fleetserve.entrypoints.cli import main

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def _write(path: Path, lines: list[Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")


def _req(custom_id: str, url: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def _cmd(inp: Path, out: Path, model: str, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "fleetserve.entrypoints.cli", "batch", "run", str(inp),
        "-o", str(out), "--model", model, "--no-progress", *extra,
    ]  # fmt: skip


def _run_here(cmd: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """`cmd` (a `_cmd` line) through the CLI's `main` in this process, which has torch and
    fleetserve imported already (a subprocess pays ~2 s of CPU for that): its stderr.
    The kill test below still runs the command as its own process."""
    argv = cmd[cmd.index("batch") :]
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 0, err
    return err


def _read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]


def test_chat_and_completion_lines_match_the_offline_llm(
    tiny_llama: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    questions = [f"question number {i}: what is {i} + {i}?" for i in range(5)]
    chat_lines: list[Any] = [
        _req(f"q{i}", CHAT, {"messages": [{"role": "user", "content": q}], "max_tokens": 8,
                             "temperature": 0, "ignore_eos": True})
        for i, q in enumerate(questions)
    ]  # fmt: skip
    chat_lines += [
        "{broken",
        _req("bad-top-p", CHAT, {"messages": [{"role": "user", "content": "x"}], "top_p": 2}),
        _req("other-url", COMPLETIONS, {"prompt": "x"}),
        _req("streamed", CHAT, {"messages": [{"role": "user", "content": "x"}], "stream": True}),
    ]
    inp, out = tmp_path / "chat.jsonl", tmp_path / "chat.out.jsonl"
    _write(inp, chat_lines)
    _run_here(_cmd(inp, out, tiny_llama, "--max-num-seqs", "4"), capsys)
    got = _read(out)
    assert [g["custom_id"] for g in got] == [
        "q0", "q1", "q2", "q3", "q4", None, "bad-top-p", "other-url", "streamed",
    ]  # fmt: skip

    llm = LLM(tiny_llama)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = llm.chat([[{"role": "user", "content": q}] for q in questions], params, use_tqdm=False)
    for g, r in zip(got[:5], ref, strict=True):
        assert g["error"] is None and g["response"]["status_code"] == 200
        body = g["response"]["body"]
        assert body["object"] == "chat.completion"
        assert body["id"] == g["response"]["request_id"]
        assert body["choices"][0]["message"]["content"] == r.outputs[0].text
        assert body["usage"]["prompt_tokens"] == len(r.prompt_token_ids)
        assert body["usage"]["completion_tokens"] == 8
    assert "not valid JSON" in got[5]["error"]["message"] and got[5]["response"] is None
    assert got[6]["response"]["status_code"] == 400
    assert got[6]["response"]["body"]["error"]["param"] == "top_p"
    assert "url must be the batch's endpoint" in got[7]["error"]["message"]
    assert got[8]["response"]["body"]["error"]["param"] == "stream"

    prompts = ["The capital of", "Once upon a time"]
    cmpl_lines = [
        _req(f"p{i}", COMPLETIONS, {"prompt": p, "max_tokens": 6, "temperature": 0,
                                    "ignore_eos": True, "model": "llama-0"})
        for i, p in enumerate(prompts)
    ]  # fmt: skip
    cmpl_lines.append(_req("wrong-model", COMPLETIONS, {"prompt": "x", "model": "gpt-4o"}))
    inp2, out2 = tmp_path / "cmpl.jsonl", tmp_path / "cmpl.out.jsonl"
    _write(inp2, cmpl_lines)
    cmd2 = _cmd(inp2, out2, tiny_llama, "--max-num-seqs", "4", "--served-model-name", "llama-0")
    _run_here(cmd2, capsys)
    got2 = _read(out2)
    ref2 = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)  # fmt: skip
    for g, r in zip(got2[:2], ref2, strict=True):
        body = g["response"]["body"]
        assert body["object"] == "text_completion" and body["model"] == "llama-0"
        assert body["choices"][0]["text"] == r.outputs[0].text
    assert got2[2]["response"]["status_code"] == 404
    assert got2[2]["error"]["code"] == "model_not_found"

    # Done already: the same command rewrites OUTPUT from the checkpoint, running nothing.
    out2.unlink()
    assert main(["batch", "run", str(inp2), "-o", str(out2), "--model", "/nonexistent"]) == 0
    assert _read(out2) == got2
    # A different INPUT for the same OUTPUT is refused, not mixed in.
    _write(inp2, cmpl_lines[:1])
    assert main(["batch", "run", str(inp2), "-o", str(out2), "--model", tiny_llama]) == 2


def test_config_and_model_flags_do_not_mix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inp = tmp_path / "in.jsonl"
    _write(inp, [_req("a", CHAT, {"messages": [{"role": "user", "content": "x"}]})])
    out = str(tmp_path / "o.jsonl")
    argv = ["batch", "run", str(inp), "-o", out, "--config", "f.yaml", "--model", "m"]
    assert main(argv) == 2
    assert "--config describes every model; leave out --model" in capsys.readouterr().err
    # The fleet file's classes say how far a replica is oversubscribed, not the flag.
    argv = ["batch", "run", str(inp), "-o", out, "--config", "f.yaml", "--oversubscribe", "2"]
    assert main(argv) == 2
    assert "leave out --oversubscribe" in capsys.readouterr().err
    assert main(["batch", "run", str(inp), "-o", out, "--oversubscribe", "0.5"]) == 2
    assert "--oversubscribe must be in [1, 64], got 0.5" in capsys.readouterr().err
    assert main(["batch", "run", str(tmp_path / "missing.jsonl"), "-o", "x"]) == 2
    assert "INPUT: cannot read" in capsys.readouterr().err


def _committed(ckpt: Path) -> dict[str, str]:
    """custom_id -> its committed JSON line, read from the checkpoint as another process."""
    db = ckpt / "batch.db"
    if not db.exists():
        return {}
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
            rows = conn.execute("SELECT custom_id, record FROM results").fetchall()
    except sqlite3.OperationalError:  # the tables are not created yet
        return {}
    return dict(rows)


def kill_once_committed(
    cmd: list[str],
    ckpt: Path,
    lines: int,
    timeout_s: float,
    env: dict[str, str] | None = None,
    running: Callable[[int], None] | None = None,
) -> dict[str, str]:
    """Runs `cmd` in a session of its own, SIGKILLs the whole session (a preempted node)
    once `lines` lines are committed to its checkpoint, and returns the committed ones.
    `running(pid)` looks at the live process just before the kill."""
    proc = subprocess.Popen(cmd, start_new_session=True, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + timeout_s
        while len(_committed(ckpt)) < lines:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "no line was committed in time"
            time.sleep(0.02)
        if running is not None:
            running(proc.pid)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    return _committed(ckpt)


def test_sigkill_mid_run_then_rerun_is_exactly_once(
    tiny_llama: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    n = 24
    lines = [
        _req(f"id-{i}", CHAT, {"messages": [{"role": "user", "content": f"count to {i}"}],
                               "max_tokens": 24, "ignore_eos": True, "temperature": 0})
        for i in range(n)
    ]  # fmt: skip
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, lines)
    ckpt = Path(f"{out}.ckpt")
    cmd = _cmd(inp, out, tiny_llama, "--max-num-seqs", "2", "--concurrency", "2")
    # Its own session, so that SIGKILL reaches the engine process too (a preempted node).
    before = kill_once_committed(cmd, ckpt, 4, timeout_s=240)
    assert 4 <= len(before) < n, "the run must be killed mid-way"
    assert not out.exists()

    # The same command again (in this process: the checkpoint, not the process, resumes).
    assert f"{n} lines ({n} ok, 0 failed)" in _run_here(cmd, capsys)
    got = out.read_text(encoding="utf-8").splitlines()
    assert [json.loads(g)["custom_id"] for g in got] == [f"id-{i}" for i in range(n)]
    # Lines committed before the kill were not run again: their records are unchanged.
    by_id = {json.loads(g)["custom_id"]: g for g in got}
    assert all(by_id[cid] == rec for cid, rec in before.items())


def test_config_fleet_serves_lines_by_model_name(
    tiny_llama: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        "models:\n"
        f"  - {{name: chat, kind: generate, model: {json.dumps(tiny_llama)},"
        " engine: {max_num_seqs: 4}}\n"
        "classes:\n"
        "  interactive: {priority: 0, max_waiting: 8}\n"
        "  batch: {priority: 10, max_waiting: 1000}\n"
        "default_class: interactive\n",
        encoding="utf-8",
    )
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, [_req(f"c{i}", CHAT, {**body, "model": "chat"}) for i in range(12)]
           + [_req("nope", CHAT, {**body, "model": "nope"})])  # fmt: skip
    cmd = [sys.executable, "-m", "fleetserve.entrypoints.cli", "batch", "run", str(inp),
           "-o", str(out), "--config", str(fleet), "--no-progress"]  # fmt: skip
    assert "13 lines (12 ok, 1 failed)" in _run_here(cmd, capsys)
    got = _read(out)
    assert all(g["response"]["body"]["model"] == "chat" for g in got[:12])
    assert got[12]["response"]["status_code"] == 404
    assert got[12]["error"]["code"] == "model_not_found"
