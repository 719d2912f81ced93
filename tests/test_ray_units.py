"""The Ray layer's pieces that need no cluster: the fleet file's autoscale and placement
keys, their mapping onto Serve's deployment options, the queue-depth policy's arithmetic,
refusals crossing the process boundary as data, and the local server refusing the keys
only Ray honours."""

from __future__ import annotations

import argparse
import pickle
from typing import Any

import pytest

from fleetserve.engine.async_engine import EngineDeadError, EngineOverloadedError
from fleetserve.serve.config.fleet_config import parse_fleet_config
from fleetserve.serve.microbatch.batcher import MicroBatchItemError
from fleetserve.serve.microbatch.services import ServiceNotReadyError


def fleet(**entry: Any) -> dict[str, Any]:
    return {"models": [{"name": "m", **entry}]}


def test_autoscale_and_placement_are_validated_by_key() -> None:
    cfg = parse_fleet_config(
        fleet(autoscale={"min_replicas": 0, "max_replicas": 3}, placement={"num_cpus": 2})
    )
    auto = cfg.models[0].autoscale
    assert auto is not None and (auto.min_replicas, auto.max_replicas) == (0, 3)
    assert cfg.ray_only_keys() == ["models[0].autoscale", "models[0].placement"]
    with pytest.raises(ValueError, match=r"models\[0\].autoscale.*exceeds max_replicas"):
        parse_fleet_config(fleet(autoscale={"min_replicas": 3, "max_replicas": 2}))
    with pytest.raises(ValueError, match="replicas or autoscale"):
        parse_fleet_config(fleet(replicas=2, autoscale={}))
    with pytest.raises(ValueError, match=r"models\[0\].autoscale.target_queue_depth"):
        parse_fleet_config(fleet(autoscale={"target_queue_depth": 0}))
    with pytest.raises(ValueError, match=r"models\[0\].placement.max_replicas_per_node"):
        parse_fleet_config(fleet(placement={"max_replicas_per_node": 0}))
    with pytest.raises(ValueError, match=r"models\[0\].placement.gpus"):
        parse_fleet_config(fleet(placement={"gpus": 1}))


def test_the_local_server_refuses_what_only_ray_honours(tmp_path: Any) -> None:
    from fleetserve.entrypoints.openai.api_server import add_cli_args, run

    path = tmp_path / "fleet.yaml"
    path.write_text("models:\n  - name: m\n    autoscale: {min_replicas: 0}\n")
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    with pytest.raises(ValueError, match=r"models\[0\].autoscale: only `fleetserve serve --ray`"):
        run(parser.parse_args(["--config", str(path)]))
    with pytest.raises(ValueError, match="--ray-address needs --ray"):
        run(parser.parse_args(["--config", str(path), "--ray-address", "auto"]))


def test_queue_depth_policy_sizes_for_seats_plus_target() -> None:
    pytest.importorskip("ray")
    from fleetserve.ray.autoscale import QueueDepthPolicy

    p = QueueDepthPolicy(seats_per_replica=4, target_queue_depth=2)
    assert p.desired(current=1, running=0, waiting=0, kv_usage=0.0) == 0  # idle: to min
    assert p.desired(current=1, running=4, waiting=2, kv_usage=0.1) == 1  # at target
    assert p.desired(current=1, running=4, waiting=3, kv_usage=0.1) == 2  # past it
    assert p.desired(current=2, running=8, waiting=16, kv_usage=0.1) == 4
    # Waiting for KV blocks, not seats: one more replica even under the target.
    assert p.desired(current=2, running=3, waiting=1, kv_usage=0.95) == 3
    with pytest.raises(ValueError, match="target_queue_depth"):
        QueueDepthPolicy(4, 0)


def test_deployment_options_follow_the_fleet_file(tiny_llama: str) -> None:
    pytest.importorskip("ray")
    from fleetserve.ray.app import model_options

    cfg = parse_fleet_config(
        {
            "models": [
                {
                    "name": "chat#1",
                    "model": tiny_llama,
                    "routing": "prefix_affinity",
                    "engine": {"max_num_seqs": 8},
                    "autoscale": {"min_replicas": 0, "max_replicas": 3, "target_queue_depth": 2},
                    "placement": {"num_cpus": 2, "resources": {"spot": 1}, "memory_gb": 1},
                },
                {"name": "emb", "kind": "embed"},
            ]
        }
    )
    opts, seats = model_options(cfg.models[0])
    assert seats == 8
    assert opts["name"] == "model-chat_1"
    assert opts["max_ongoing_requests"] == 8 + 4
    assert opts["ray_actor_options"] == {
        "num_cpus": 2,
        "memory": 2**30,
        "resources": {"spot": 1},
    }
    auto = opts["autoscaling_config"]
    assert (auto["min_replicas"], auto["initial_replicas"], auto["max_replicas"]) == (0, 0, 3)
    assert auto["policy"]["policy_kwargs"] == {"seats_per_replica": 8, "target_queue_depth": 2}
    assert "num_replicas" not in opts
    router = opts["request_router_config"]
    assert router["request_router_kwargs"]["policy"] == "prefix_affinity"
    opts, seats = model_options(cfg.models[1])
    assert (opts["num_replicas"], seats) == (1, 32)
    assert "request_router_config" not in opts and "autoscaling_config" not in opts


@pytest.mark.parametrize(
    ("error", "batch", "expected"),
    [
        (ValueError("bad max_tokens"), False, ValueError),
        (EngineOverloadedError("full"), False, EngineOverloadedError),
        (EngineDeadError("gone"), False, EngineDeadError),
        (ServiceNotReadyError("loading"), True, ServiceNotReadyError),
        (RuntimeError("bug"), True, RuntimeError),
    ],
)
def test_refusals_cross_as_data(error: Exception, batch: bool, expected: type) -> None:
    from fleetserve.ray.wire import RemoteError

    remote = pickle.loads(pickle.dumps(RemoteError.of(error)))
    rebuilt = remote.exception(batch)
    assert type(rebuilt) is expected and str(rebuilt) == str(error)


def test_a_failed_batch_item_keeps_its_index() -> None:
    from fleetserve.ray.wire import RemoteError

    remote = RemoteError.of(MicroBatchItemError(3, ValueError("cannot classify")))
    rebuilt = pickle.loads(pickle.dumps(remote)).exception(batch=True)
    assert isinstance(rebuilt, MicroBatchItemError) and rebuilt.index == 3
    assert isinstance(rebuilt.error, ValueError) and str(rebuilt.error) == "cannot classify"


def test_fleetserve_and_the_local_server_do_not_import_ray() -> None:
    import subprocess
    import sys

    code = (
        "import sys, fleetserve, fleetserve.entrypoints.openai.api_server, "
        "fleetserve.serve.services.service_registry; print('ray' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_spot_pools_notice_is_served_on_ray() -> None:
    """Behaviour changed (issue 20): a pool's cloud notice was refused on Ray; its spot
    pool's replicas' engines now get the notice config (they poll their own node)."""
    from fleetserve.ray.app import build_app

    pools = [
        {"name": "spot", "capacity": "spot", "replicas": 1, "notice": {"provider": "gcp"}},
        {"name": "base", "capacity": "on_demand", "replicas": 1},
    ]
    data = {
        **fleet(pools=pools),
        "classes": {"fast": {"hedge_after_s": 1.0}},
    }
    app = build_app(parse_fleet_config(data))
    # The ingress's arguments: (fleet, handles, max_ongoing, options, pool_handles).
    pool_handles = app._bound_deployment.init_args[4]
    bound = {
        name: pool_app._bound_deployment.init_args for name, pool_app in pool_handles["m"].items()
    }
    # GenerateReplica(model_name, args, resilience, notice)
    assert bound["spot"][3] == {
        "provider": "gcp",
        "url": None,
        "poll_interval_s": 1.0,
        "resource_name": None,
    }
    assert bound["base"][3] is None


class _Method:
    """One deployment method of a fake handle: `.remote(arg)` answers with `reply(arg)`."""

    def __init__(self, reply: Any) -> None:
        self.reply = reply
        self.args: list[tuple[Any, ...]] = []

    def remote(self, *args: Any) -> Any:
        self.args.append(args)

        async def answer() -> Any:
            result = self.reply(*args)
            if isinstance(result, BaseException):
                raise result
            return result

        return answer()


def test_ray_batch_clients_check_readiness_and_input_and_map_refusals() -> None:
    import asyncio
    from types import SimpleNamespace

    import numpy as np

    pytest.importorskip("ray")
    from fleetserve.entrypoints.openai.fleet_client import SubCall
    from fleetserve.ray.fleet_client import Predicted
    from fleetserve.ray.microbatch_clients import RayCustomClient, RayEmbedClient
    from fleetserve.ray.wire import RemoteError

    cfg = parse_fleet_config(
        {
            "models": [
                {"name": "emb", "kind": "embed", "model": "all-MiniLM-L6-v2"},
                {"name": "cus", "kind": "custom", "handler": "pkg.mod:Model"},
            ]
        }
    )
    vectors = np.ones((2, 3), dtype=np.float32)

    def embed(inputs: list[Any]) -> Any:
        if inputs == ["bad"]:
            return RemoteError.of(MicroBatchItemError(0, ValueError("input[0] is bad")))
        return vectors[: len(inputs)], [4] * len(inputs)

    emb_handle = SimpleNamespace(
        deployment_name="model-emb", dimension=_Method(lambda: 3), embed=_Method(embed)
    )
    predict = _Method(lambda xs, cls: Predicted([{"y": x["x"] + 1} for x in xs]))
    cus_handle = SimpleNamespace(deployment_name="model-cus", predict=predict)
    emb = RayEmbedClient(cfg.models[0], emb_handle)  # type: ignore[arg-type]
    cus = RayCustomClient(cfg.models[1], cus_handle)  # type: ignore[arg-type]

    async def main() -> None:
        assert (emb.dead_reason, emb.crashed, cus.dead_reason, cus.crashed) == (
            None, False, None, False
        )  # fmt: skip
        with pytest.raises(ServiceNotReadyError, match="model 'emb' is not ready"):
            _ = emb.dimension
        with pytest.raises(ServiceNotReadyError, match="model 'cus' is not ready"):
            await cus.predict([{"x": 1}])
        await emb.start()
        await cus.start()
        assert emb.dimension == 3 and emb.is_ready
        result = await emb.embed(["a", "b"])
        assert result.vectors.shape == (2, 3) and result.num_tokens == [4, 4]
        with pytest.raises(MicroBatchItemError) as bad:
            await emb.embed(["bad"])
        assert bad.value.index == 0 and isinstance(bad.value.error, ValueError)
        with pytest.raises(ValueError, match="instances must not be empty"):
            await cus.predict([])
        with pytest.raises(ValueError, match=r"instances\[1\] must be a JSON object"):
            await cus.predict([{"x": 1}, 2])  # type: ignore[list-item]
        assert len(predict.args) == 0  # refused before any call
        assert await cus.predict([{"x": 1}]) == [{"y": 2}]
        # The request's class goes to the replica; its handler's sub-calls come back.
        sub = SubCall("tiny", "chat", 200, 1.5)
        predict.reply = lambda xs, cls: Predicted([{"y": cls}], (sub,))
        subs: list[SubCall] = []
        assert await cus.predict([{"x": 1}], "batch", subs) == [{"y": "batch"}]
        assert subs == [sub]
        predict.reply = lambda xs, cls: RuntimeError("actor died")
        with pytest.raises(RuntimeError, match="the replica serving the request failed"):
            await cus.predict([{"x": 1}])
        assert cus.num_in_flight == 0
        cus.abort_all("stop")
        with pytest.raises(ServiceNotReadyError, match="model 'cus' is not ready"):
            await cus.predict([{"x": 1}])

    asyncio.run(main())
