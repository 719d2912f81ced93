"""Custom models: loading "module:Class" handlers, their output contract, CustomService."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from fleetserve.serve.microbatch.batcher import MicroBatchConfig, MicroBatchItemError
from fleetserve.serve.microbatch.custom import HandlerError, load_handler, parse_handler_spec
from fleetserve.serve.microbatch.services import CustomService, ServiceNotReadyError


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("fleet_handlers.Classifier", "must look like 'package.module:ClassName'"),
        ("a:b:c", "must look like"),
        ("fleet_handlers:", "must be dotted Python names"),
        ("1bad.mod:Class", "must be dotted Python names"),
        ("no_such_module_xyz:Model", "module 'no_such_module_xyz' not found"),
        ("fleet_handlers:Missing", "'fleet_handlers' has no 'Missing'"),
        ("fleet_handlers:NOT_A_CLASS", "is a int, not a class"),
        ("fleet_handlers:not_a_class", "is a function, not a class"),
        ("fleet_handlers:NotCallable", "not callable"),
    ],
)
def test_bad_handler_specs_are_a_clear_value_error(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match="handler") as info:
        load_handler(spec, {"labels": ["x"]} if "Classifier" in spec else None)
    assert message in str(info.value)


def test_malformed_spec_fails_before_importing() -> None:
    with pytest.raises(ValueError, match="handler"):
        CustomService("clf", "no colon here")
    assert parse_handler_spec("fleet_handlers:Classifier").module == "fleet_handlers"


def test_a_module_that_fails_to_import_is_told_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "broken_handler_mod.py").write_text("import not_installed_dep_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="importing 'broken_handler_mod' failed"):
        load_handler("broken_handler_mod:Model")


def test_options_go_to_init_and_bad_options_name_them() -> None:
    model = load_handler("fleet_handlers:Classifier", {"labels": ["even", "odd"]})
    assert model([{"text": "ab"}, {"text": "abc"}]) == [
        {"label": "even", "length": 2},
        {"label": "odd", "length": 3},
    ]
    with pytest.raises(ValueError, match="options for handler"):
        load_handler("fleet_handlers:Classifier", {"labelz": ["x"]})


def test_output_contract_is_checked() -> None:
    with pytest.raises(HandlerError, match="returned 2 predictions for 1 instances"):
        load_handler("fleet_handlers:WrongLength")([{}])
    with pytest.raises(HandlerError, match="returned a dict, not a list"):
        load_handler("fleet_handlers:NotAList")([{}])
    out = load_handler("fleet_handlers:BadPredictions")([{"set": True}, {}])
    assert isinstance(out[0], HandlerError) and "non-JSON" in str(out[0])
    assert isinstance(out[1], HandlerError) and "a str as a prediction" in str(out[1])
    crashed = load_handler("fleet_handlers:Crashy")([{"crash": True}, {}])
    assert isinstance(crashed[0], ZeroDivisionError) and crashed[1] == {"ok": True}


def _service(handler: str, **options: Any) -> CustomService:
    return CustomService(
        "clf",
        handler,
        options=options,
        batching=MicroBatchConfig(max_batch_size=4, batch_wait_timeout_s=3600, max_waiting=64),
    )


def test_a_failing_instance_fails_its_request_only(tmp_path: Path) -> None:
    log = tmp_path / "batches.jsonl"  # the handler runs in its own process: it logs there
    svc = _service("fleet_handlers:Classifier", labels=["a", "b", "c"], log=str(log))

    async def main() -> list[Any]:
        with pytest.raises(ServiceNotReadyError):
            await svc.predict([{"text": "x"}])
        await svc.start()
        assert svc.is_ready and svc.kind == "custom"
        requests = [[{"text": "hi"}], [{"text": "boom"}, {"text": "ok"}], [{"text": "hey"}]]
        out = await asyncio.gather(*(svc.predict(r) for r in requests), return_exceptions=True)
        await svc.shutdown()
        assert not svc.is_ready
        return out

    out = asyncio.run(main())
    assert out[0] == [{"label": "c", "length": 2}]
    assert out[2] == [{"label": "a", "length": 3}]
    err = out[1]
    assert isinstance(err, MicroBatchItemError) and err.index == 0
    assert isinstance(err.error, ValueError) and "cannot classify 'boom'" in str(err.error)
    # One batch of all four instances, then each alone to find the one that fails.
    batches = [json.loads(line) for line in log.read_text().splitlines()]
    texts = [[i["text"] for i in b] for b in batches]
    assert texts == [["hi", "boom", "ok", "hey"], ["hi"], ["boom"], ["ok"], ["hey"]]


def test_instances_must_be_objects() -> None:
    svc = _service("fleet_handlers:Crashy")

    async def main() -> None:
        await svc.start()
        with pytest.raises(ValueError, match=r"instances\[1\] must be a JSON object"):
            await svc.predict([{}, [1, 2]])  # type: ignore[list-item]
        with pytest.raises(ValueError, match="instances must not be empty"):
            await svc.predict([])

    asyncio.run(main())
