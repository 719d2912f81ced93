"""The gateway <-> pod schema (serve/remote/wire.py), the remote pool's address keeping
(serve/remote/targets.py) and the `remote:` config, without servers (tests/server/
test_gateway.py runs them for real)."""

from __future__ import annotations

import asyncio
import copy
import math
import random
from dataclasses import dataclass

import pytest

from fleetserve.core.sampling_params import SamplingParams
from fleetserve.outputs import CompletionOutput, RequestOutput, fold
from fleetserve.serve.admission.sla import ServiceClass, engine_priority, split_engine_priority
from fleetserve.serve.config.fleet_config import RemoteConfig, parse_fleet_config
from fleetserve.serve.remote.targets import POOL_NAME, RemoteTargets
from fleetserve.serve.remote.wire import (
    ErrorFrame,
    FrameReader,
    FrameWriter,
    OutputFrame,
    check_resume,
    params_from_http,
    params_to_http,
)
from fleetserve.serve.replicas.pool_plan import MemberView, PoolController, Start

PROMPT = [11, 12, 13]


def delta_outputs() -> list[RequestOutput]:
    """A request of n=2 as the OutputProcessor streams it (deltas): choice 1 stops at
    step 3 and is in no later delta, logprobs include -inf, prompt logprobs come once."""
    outs = []
    for step in range(1, 7):
        choices = []
        for i in range(2 if step <= 3 else 1):
            finish = "stop" if i == 1 and step == 3 else ("length" if step == 6 else None)
            t = step - 1
            lps = [{t: -math.inf if t % 5 == 0 else -0.1 * t}]
            choices.append(CompletionOutput(i, f"<{t}>", [t], finish, None, lps, -0.5 * step))
        outs.append(
            RequestOutput(
                "r",
                "p",
                PROMPT,
                choices,
                step == 6,
                [None, {12: -1.0}, {13: -2.0}] if step == 1 else None,
                num_cached_tokens=2,
                metrics={"arrival": 1.0} if step == 6 else {},
            )  # fmt: skip
        )
    return outs


def replay(outs: list[RequestOutput]) -> list[RequestOutput]:
    """Writes `outs` as frames, cuts the bytes at random points, reads them back."""
    writer = FrameWriter()
    data = b"".join(writer.output(o) for o in outs)
    reader = FrameReader("r", "p", PROMPT)
    rng = random.Random(0)
    got: list[RequestOutput] = []
    pos = 0
    while pos < len(data):
        cut = min(len(data), pos + rng.randint(1, 40))
        for frame in reader.feed(data[pos:cut]):
            assert isinstance(frame, OutputFrame)
            got.append(reader.delta(frame))
        pos = cut
    return got


def test_frames_carry_every_delta_as_it_is() -> None:
    outs = delta_outputs()
    got = replay(outs)
    assert got == outs
    whole = fold(got)
    assert whole == fold(outs)
    assert whole.outputs[0].token_ids == [0, 1, 2, 3, 4, 5]
    assert whole.outputs[1].token_ids == [0, 1, 2] and whole.outputs[1].finish_reason == "stop"
    assert whole.outputs[1].text == "<0><1><2>" and whole.prompt_logprobs == outs[0].prompt_logprobs


def test_a_frame_holds_only_what_is_new() -> None:
    outs = delta_outputs()
    writer = FrameWriter()
    reader = FrameReader("r", "p", PROMPT)
    (frame,) = reader.feed(writer.output(outs[3]))
    assert isinstance(frame, OutputFrame)
    assert [c.token_ids for c in frame.choices] == [[3]]
    assert frame.prompt_logprobs is None


def test_error_frame_round_trip() -> None:
    writer = FrameWriter()
    reader = FrameReader("r", None, PROMPT)
    err = ErrorFrame(503, "the server is shutting down", "engine_unavailable", None, True)
    assert reader.feed(writer.error(err)) == [err]


def test_sampling_params_travel_by_name() -> None:
    p = SamplingParams(n=2, temperature=0.7, seed=3, stop=["x"], max_tokens=9, logprobs=2)
    assert params_from_http(params_to_http(p)) == p
    bad = params_to_http(p)
    bad.top_p = 2.0
    with pytest.raises(ValueError, match="top_p"):
        params_from_http(bad)


def test_structured_outputs_travel_with_the_params() -> None:
    """A request handed to a remote replica (or migrated to one) keeps its constraint."""
    import msgspec

    from fleetserve.core.structured import StructuredOutputsParams
    from fleetserve.serve.remote.wire import HttpSamplingParams

    for so in (
        StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
        StructuredOutputsParams(choice=["yes", "no"]),
        StructuredOutputsParams(regex="[a-z]+"),
        StructuredOutputsParams(json_object=True),
    ):
        p = SamplingParams(max_tokens=9, structured_outputs=so)
        data = msgspec.msgpack.encode(params_to_http(p))
        assert params_from_http(msgspec.msgpack.decode(data, type=HttpSamplingParams)) == p


def test_check_resume_names_the_field() -> None:
    params = SamplingParams(n=2, max_tokens=6)
    good = fold(delta_outputs()[:3])  # a resume is a whole answer so far
    check_resume(good, PROMPT, params, vocab=100)
    cases = {
        "prompt_token_ids": dict(prompt_token_ids=[1]),
        "entries for n=2": dict(outputs=good.outputs[:1]),
        r"token_ids must be in \[0, 2\)": {},
    }
    for match, change in cases.items():
        broken = copy.deepcopy(good)
        for k, v in change.items():
            setattr(broken, k, v)
        vocab = 2 if not change else 100
        with pytest.raises(ValueError, match=match):
            check_resume(broken, PROMPT, params, vocab)
    with pytest.raises(ValueError, match="max_tokens=2"):
        check_resume(good, PROMPT, SamplingParams(n=2, max_tokens=2), 100)
    done = fold(delta_outputs())
    with pytest.raises(ValueError, match="every output has finished"):
        check_resume(done, PROMPT, params, 100)


def test_engine_priority_splits_back() -> None:
    for cls_priority in (0, 1, 10, 1_000_000):
        for req in (-(2**31), -5, 0, 7, 2**31 - 1):
            folded = engine_priority(ServiceClass("c", cls_priority), req)
            assert split_engine_priority(folded) == (cls_priority, req)


def test_remote_config_is_checked() -> None:
    for bad, match in [
        ({}, "urls or dns"),
        ({"urls": ["http://a:1"], "dns": "a.b.svc:80"}, "urls or dns"),
        ({"urls": ["a:1"]}, "http://host:port"),
        ({"urls": ["http://a:1", "http://a:1"]}, "each pod once"),
        ({"dns": "svc"}, "SERVICE.NAMESPACE.svc:PORT"),
    ]:
        with pytest.raises(ValueError, match=match):
            RemoteConfig.model_validate(bad)
    entry = {"name": "m", "remote": {"urls": ["http://127.0.0.1:8001"]}}
    fleet = parse_fleet_config({"models": [entry]})
    assert fleet.models[0].remote is not None
    with pytest.raises(ValueError, match="leave out replicas"):
        parse_fleet_config({"models": [{**entry, "replicas": 2}]})
    with pytest.raises(ValueError, match="remote is for generate models"):
        parse_fleet_config({"models": [{**entry, "kind": "embed"}]})


@dataclass
class FakeReplica:
    index: int
    url: str
    dead_reason: str | None = None
    draining: bool = False


class FakeService:
    name = "m"

    def __init__(self, members: list[FakeReplica]) -> None:
        self.replica_set = members
        self.drained: list[int] = []
        self.targets: list[tuple[str, int]] = []

    def start_drain(self, index: int, timeout_s: float) -> bool:
        self.drained.append(index)
        return True

    def set_pool_target(self, pool: str, replicas: int) -> None:
        self.targets.append((pool, replicas))


def test_addresses_are_claimed_once_and_follow_dns() -> None:
    targets = RemoteTargets(RemoteConfig(urls=["http://a:1", "http://b:1", "http://c:1"]))
    members = [FakeReplica(0, "http://a:1"), FakeReplica(1, "http://b:1", dead_reason="gone"),
               FakeReplica(2, "http://c:1", draining=True)]  # fmt: skip
    assert targets.claim(members) == "http://b:1"  # a dead replica holds nothing
    assert targets.claim(members[:1] + [FakeReplica(3, "http://b:1")]) == "http://c:1"
    assert targets.pool().name == POOL_NAME and targets.pool().replicas == 3
    service = FakeService(members)
    targets.update(service, ["http://a:1", "http://d:1"])
    assert service.drained == [2] and service.targets == [(POOL_NAME, 2)]  # c left; b is dead
    assert targets.claim(members) == "http://d:1"


def test_dns_names_resolve_to_urls() -> None:
    targets = RemoteTargets(RemoteConfig(dns="localhost:8123"))
    assert targets.pool().replicas == 0
    urls = asyncio.run(targets.resolve())
    assert "http://127.0.0.1:8123" in urls


class NoMembers:
    async def start(self, pool: object) -> int:
        raise AssertionError("not started in this test")

    async def stop(self, index: int) -> None: ...

    def members(self) -> list[MemberView]:
        return []


def test_pool_target_follows_the_addresses() -> None:
    pool = RemoteTargets(RemoteConfig(dns="pods.ns.svc:8000")).pool()
    controller = PoolController([pool], NoMembers())
    assert controller.actions() == []
    controller.set_target(POOL_NAME, 2)
    assert controller.actions() == [Start(POOL_NAME), Start(POOL_NAME)]
    with pytest.raises(KeyError):
        controller.set_target("elsewhere", 1)
