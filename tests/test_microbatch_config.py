"""One MicroBatchConfig: the fleet file's `batching:` is the batcher's own config class,
with the same limits whether it comes from the file or from code."""

from __future__ import annotations

import pytest

from fleetserve.serve.config.fleet_config import parse_fleet_config
from fleetserve.serve.microbatch.batcher import MAX_BATCH_SIZE, MicroBatchConfig


def embed(batching: dict[str, object]) -> dict[str, object]:
    return {"models": [{"name": "e", "kind": "embed", "batching": batching}]}


def test_the_fleet_file_section_is_the_batchers_config() -> None:
    cfg = parse_fleet_config(embed({"max_batch_size": 8, "batch_wait_timeout_s": 0.5}))
    got = cfg.models[0].batching
    assert type(got) is MicroBatchConfig
    assert got == MicroBatchConfig(8, 0.5)


@pytest.mark.parametrize(
    ("batching", "key"),
    [
        ({"max_batch_size": MAX_BATCH_SIZE + 1}, "max_batch_size"),
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"max_batch_size": True}, "max_batch_size"),
        ({"batch_wait_timeout_s": -1.0}, "batch_wait_timeout_s"),
        ({"batch_wait_timeout_s": 3601.0}, "batch_wait_timeout_s"),
        ({"max_waiting": 0}, "max_waiting"),
    ],
)
def test_same_limits_from_the_file_and_from_code(batching: dict[str, object], key: str) -> None:
    with pytest.raises(ValueError, match=rf"models\[0\]\.batching\.{key} \(model 'e'\)"):
        parse_fleet_config(embed(batching))
    with pytest.raises(ValueError, match=key):
        MicroBatchConfig(**batching)  # type: ignore[arg-type]


def test_unknown_batching_key_is_named() -> None:
    with pytest.raises(ValueError, match=r"batching\.max_batch \(model 'e'\): Extra inputs"):
        parse_fleet_config(embed({"max_batch": 4}))
