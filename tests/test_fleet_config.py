"""The fleet file: the issue's example parses; every bad key or value is refused with its
path, before anything loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetserve.serve.config.fleet_config import load_fleet_config, parse_fleet_config

EXAMPLE = """
models:
  - name: chat
    kind: generate
    model: null
    replicas: 2
    routing: prefix_affinity
    engine: {max_num_seqs: 32, num_threads: 1}
  - name: minilm
    kind: embed
    model: all-MiniLM-L6-v2
    batching: {max_batch_size: 32, batch_wait_timeout_s: 0.01}
  - name: classifier
    kind: custom
    handler: mypkg.vision:Classifier
    options: {threshold: 0.5}
    batching: {max_batch_size: 8, batch_wait_timeout_s: 0.02}
classes:
  interactive: {priority: 0, max_waiting: 64, max_queue_time_s: 5}
  batch: {priority: 10, max_waiting: 100000, oversubscribe: 2}
default_class: interactive
"""


def test_the_example_parses(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text(EXAMPLE)
    cfg = load_fleet_config(str(path))
    chat, minilm, clf = cfg.models
    args = chat.engine_args()
    assert (args.model, args.max_num_seqs, args.num_threads) == (None, 32, 1)
    # A fleet's engines order by priority unless told otherwise (classes reach the engine).
    assert args.scheduling_policy == "priority"
    assert (chat.replicas, chat.routing) == (2, "prefix_affinity")
    assert minilm.batching is not None and minilm.batching.max_batch_size == 32
    assert clf.handler == "mypkg.vision:Classifier" and clf.options == {"threshold": 0.5}
    classes = cfg.service_classes()
    assert classes["interactive"].max_queue_time_s == 5.0
    assert classes["batch"].priority == 10 and classes["batch"].max_queue_time_s is None
    assert (classes["interactive"].oversubscribe, classes["batch"].oversubscribe) == (1.0, 2.0)
    assert cfg.default_class_name == "interactive"


def one(**model: object) -> dict[str, object]:
    return {"models": [{"name": "chat", **model}]}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (one(engine={"max_num_sqs": 3}),
         "models[0].engine.max_num_sqs (model 'chat'): Extra inputs are not permitted"),
        (one(engine={"max_num_seqs": "8"}),
         "models[0].engine.max_num_seqs (model 'chat'): Input should be a valid integer"),
        (one(replicas=0), "models[0].replicas (model 'chat'): Input should be greater than"),
        (one(kind="vision"), "models[0].kind (model 'chat'): Input should be 'generate'"),
        (one(routing="random"), "models[0].routing (model 'chat'): Input should be"),
        (one(kind="custom"), "models[0] (model 'chat'): a custom model needs handler"),
        (one(kind="embed", engine={}), "engine is for generate models, not 'embed'"),
        (one(kind="embed", replicas=2), "replicas is for generate models, not 'embed'"),
        (one(batching={"max_batch_size": 4}), "batching is for embed and custom models"),
        (one(handler="a:B"), "handler and options are for kind 'custom'"),
        (one(kind="embed", batching={"max_batch_size": 0}),
         "models[0].batching.max_batch_size (model 'chat'): Input should be greater than"),
        (one(name="bad name"), "name 'bad name'"),
        ({"models": [{"name": "a"}, {"name": "a"}]}, "model names must be unique; repeated: a"),
        ({"models": []}, "models: List should have at least 1 item"),
        ({"modles": []}, "modles: Extra inputs are not permitted"),
        ({**one(), "classes": {"a": {"max_waiting": -1}}},
         "classes.a.max_waiting: Input should be greater than or equal to 0"),
        ({**one(), "classes": {"a": {"max_queue_time_s": 0}}},
         "classes.a.max_queue_time_s: Input should be greater than 0"),
        ({**one(), "classes": {"a": {"priorty": 1}}}, "classes.a.priorty: Extra inputs"),
        ({**one(), "classes": {"a": {"oversubscribe": 0.5}}},
         "classes.a.oversubscribe: Input should be greater than or equal to 1"),
        ({**one(), "classes": {"a": {"oversubscribe": 2}, "b": {}}, "default_class": "a"},
         "classes: 'a' and 'b' share priority 0 (and so a replica's seats) but not "
         "oversubscribe; give them the same one"),
        ({**one(), "classes": {"a": {}, "b": {}}}, "default_class is required"),
        ({**one(), "classes": {"a": {}}, "default_class": "b"},
         "default_class 'b' is not one of the classes (a)"),
        ([1, 2], "expected a mapping with a 'models' list"),
        (one(tool_parser="mistrall"), "models[0].tool_parser (model 'chat'): Input should be"),
        (one(kind="embed", tool_parser="hermes"), "tool_parser is for generate models"),
    ],
)  # fmt: skip
def test_errors_name_the_key(data: object, message: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_fleet_config(data, "fleet.yaml")
    assert str(e.value).startswith("fleet.yaml: ")
    assert message in str(e.value)


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--config .*nope.yaml: No such file"):
        load_fleet_config(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_fleet_config(str(bad))


def test_defaults_make_a_fleet_of_one() -> None:
    cfg = parse_fleet_config({"models": [{"name": "m"}]})
    assert list(cfg.service_classes()) == ["default"] and cfg.default_class_name == "default"
    args = cfg.models[0].engine_args()
    assert args.max_num_seqs == 64 and args.scheduling_policy == "priority"


def test_serve_refuses_a_bad_file_before_loading_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from fleetserve.entrypoints.cli import main

    bad = tmp_path / "fleet.yaml"
    bad.write_text("models:\n  - name: chat\n    engine: {max_num_seq: 4}\n")
    assert main(["serve", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "models[0].engine.max_num_seq (model 'chat'): Extra inputs are not permitted" in err
    good = tmp_path / "good.yaml"
    good.write_text("models:\n  - name: chat\n")
    # A model flag next to --config would be ignored: refused instead.
    assert main(["serve", "--config", str(good), "--max-num-seqs", "8", "--model", "x"]) == 2
    assert "leave out --model, --max-num-seqs" in capsys.readouterr().err


def test_tool_parser_per_model() -> None:
    cfg = parse_fleet_config(
        {"models": [{"name": "m", "tool_parser": "mistral"}, {"name": "n"}]}, "fleet.yaml"
    )
    assert [m.tool_parser for m in cfg.models] == ["mistral", None]
