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
from fleetserve.outputs import CompletionOutput, RequestOutput
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


def cumulative_outputs() -> list[RequestOutput]:
    """A request of n=2 as the OutputProcessor would stream it: choice 1 stops early,
    logprobs include -inf, prompt logprobs come with the first output."""
    outs = []
    for step in range(1, 7):
        choices = []
        for i in range(2):
            k = min(step, 3) if i == 1 else step
            finish = "stop" if i == 1 and step >= 3 else ("length" if step == 6 else None)
            lps = [{t: (-math.inf if t % 5 == 0 else -0.1 * t)} for t in range(k)]
            choices.append(CompletionOutput(i, "".join(f"<{t}>" for t in range(k)),
                                            list(range(k)), finish, None, lps,
                                            -0.5 * k))  # fmt: skip
        outs.append(
            RequestOutput(
                "r",
                "p",
                PROMPT,
                choices,
                step == 6,
                [None, {12: -1.0}, {13: -2.0}],
                num_cached_tokens=2,
                metrics={"arrival": 1.0},
            )  # fmt: skip
        )
    return outs


def replay(outs: list[RequestOutput], resume: RequestOutput | None) -> list[RequestOutput]:
    """Writes `outs` as frames, cuts the bytes at random points, reads them back."""
    writer = FrameWriter(2, resume)
    data = b"".join(writer.output(o) for o in outs)
    reader = FrameReader("r", "p", PROMPT, 2, copy.deepcopy(resume))
    rng = random.Random(0)
    got: list[RequestOutput] = []
    pos = 0
    while pos < len(data):
        cut = min(len(data), pos + rng.randint(1, 40))
        for frame in reader.feed(data[pos:cut]):
            assert isinstance(frame, OutputFrame)
            got.append(reader.apply(frame))
        pos = cut
    return got


def test_frames_rebuild_every_cumulative_output() -> None:
    outs = cumulative_outputs()
    got = replay(outs, None)
    assert got == outs
    assert got[0] is not got[1] and got[0].outputs[0].token_ids == [0]  # not mutated later


def test_frames_resume_where_the_gateway_left_off() -> None:
    outs = cumulative_outputs()
    resume = outs[2]
    got = replay(outs[3:], resume)
    assert got == outs[3:]
    # Only what is new travels: the first frame after the resume carries one token.
    writer = FrameWriter(2, resume)
    reader = FrameReader("r", "p", PROMPT, 2, resume)
    (frame,) = reader.feed(writer.output(outs[3]))
    assert isinstance(frame, OutputFrame)
    assert [c.token_ids for c in frame.choices] == [[3], []]
    assert frame.prompt_logprobs is None


def test_error_frame_round_trip() -> None:
    writer = FrameWriter(1, None)
    reader = FrameReader("r", None, PROMPT, 1, None)
    err = ErrorFrame(503, "the server is shutting down", "engine_unavailable", None, True)
    assert reader.feed(writer.error(err)) == [err]


def test_sampling_params_travel_by_name() -> None:
    p = SamplingParams(n=2, temperature=0.7, seed=3, stop=["x"], max_tokens=9, logprobs=2)
    assert params_from_http(params_to_http(p)) == p
    bad = params_to_http(p)
    bad.top_p = 2.0
    with pytest.raises(ValueError, match="top_p"):
        params_from_http(bad)


def test_check_resume_names_the_field() -> None:
    params = SamplingParams(n=2, max_tokens=6)
    good = cumulative_outputs()[2]
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
    done = cumulative_outputs()[-1]
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
