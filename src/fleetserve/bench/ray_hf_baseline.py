"""The baseline fleetserve is measured against: Ray Serve around HF transformers `generate()`.

This is the pattern most users try first: one Ray Serve deployment whose replica loads an
`AutoModelForCausalLM` and runs `generate()` for one request per call (no batching across
requests, no paged KV cache). It speaks enough of the OpenAI completions API for
`fleetserve bench serve`: `POST /v1/completions` (streaming SSE or not, `max_tokens`,
`temperature`, `ignore_eos`, `stream_options.include_usage`), `GET /v1/models`, `/ready`.

    python -m fleetserve.bench.ray_hf_baseline --model PATH --port 8001

The Ray cluster is local: bound to 127.0.0.1, no dashboard, a small object store.
Ray is imported only here (the `[ray]` extra); nothing else in fleetserve imports this module.
"""

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from transformers.generation.streamers import BaseStreamer

# Ray pickles the deployment by reference: replicas import this module by its name (main()
# below makes sure of it), so every class and handler here is defined at module level.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Ray starts workers at nice 15; on a shared machine that would starve the replica against
# other processes (the server it is compared with runs at nice 0).
os.environ.setdefault("RAY_worker_niceness", "0")


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: SmolLM2)")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--num-cpus", type=int, default=2, help="CPUs of the local Ray cluster")
    p.add_argument("--num-threads", type=int, default=2, help="torch threads per replica")
    p.add_argument("--num-replicas", type=int, default=1)
    p.add_argument(
        "--max-ongoing-requests",
        type=int,
        default=1,
        help="requests a replica runs at once (each its own generate call); others queue",
    )
    p.add_argument("--object-store-mb", type=int, default=200)
    p.add_argument(
        "--token-delay-s",
        type=float,
        default=0.0,
        help="sleep this long before each streamed token, as a slower device would (the "
        "counterpart of fleetserve's FLEETSERVE_DEBUG_STEP_DELAY_S in `bench chaos`)",
    )


def load_hf(model_path: str) -> tuple[Any, Any]:
    """(model, tokenizer) in float32 from an HF folder or a GGUF file (dequantized)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {}
    folder = model_path
    if model_path.endswith(".gguf"):
        folder, kwargs["gguf_file"] = os.path.split(os.path.abspath(model_path))
    tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs).eval()
    return model, tokenizer


class _Done:
    """The end of a token stream: `error` says why generate failed, if it did."""

    def __init__(self, error: str | None = None) -> None:
        self.error = error


class TokenQueueStreamer(BaseStreamer):
    """Hands each new token id from generate's thread to the event loop's queue."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, queue: "asyncio.Queue[Any]", delay_s: float = 0.0
    ) -> None:
        self.loop = loop
        self.queue = queue
        self.delay_s = delay_s
        self.seen_prompt = False

    def put(self, value: Any) -> None:
        if not self.seen_prompt:  # generate's first put is the prompt itself
            self.seen_prompt = True
            return
        if self.delay_s:
            time.sleep(self.delay_s)  # generate's own thread: only this request slows
        for tid in value.reshape(-1).tolist():
            self.loop.call_soon_threadsafe(self.queue.put_nowait, tid)

    def end(self) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, _Done())


class HFCompletions:
    """The replica: one model, one `generate()` per request."""

    def __init__(
        self, model_path: str, served_name: str, num_threads: int, token_delay_s: float = 0.0
    ) -> None:
        import torch

        torch.set_num_threads(num_threads)
        self.model, self.tokenizer = load_hf(model_path)
        self.served_name = served_name
        self.eos_token_id = self.tokenizer.eos_token_id
        self.token_delay_s = token_delay_s

    def _generate(self, ids: list[int], params: dict[str, Any], streamer: Any) -> list[int]:
        import torch

        kwargs: dict[str, Any] = {"max_new_tokens": params["max_tokens"]}
        if params["ignore_eos"]:
            kwargs["min_new_tokens"] = params["max_tokens"]
        if params["temperature"] > 0:
            kwargs.update(do_sample=True, temperature=params["temperature"], top_k=0)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        input_ids = torch.tensor([ids])
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                pad_token_id=self.eos_token_id,
                streamer=streamer,
                **kwargs,
            )
        return out[0, len(ids) :].tolist()

    def _generate_into(
        self, ids: list[int], params: dict[str, Any], streamer: TokenQueueStreamer
    ) -> None:
        """`_generate` for a stream: a failure ends the stream instead of leaving it waiting."""
        try:
            self._generate(ids, params, streamer)
        except Exception as e:  # noqa: BLE001 -- any failure must reach the client
            streamer.loop.call_soon_threadsafe(streamer.queue.put_nowait, _Done(str(e)))

    def _finish_reason(self, output_ids: list[int], max_tokens: int) -> str:
        return "length" if len(output_ids) >= max_tokens else "stop"

    def _chunk(self, req_id: str, created: int, choices: list[Any], **extra: Any) -> str:
        body = {
            "id": req_id,
            "object": "text_completion",
            "created": created,
            "model": self.served_name,
            "choices": choices,
            **extra,
        }
        return f"data: {json.dumps(body)}\n\n"

    async def complete(self, body: dict[str, Any]) -> dict[str, Any] | AsyncIterator[str]:
        params = _params(body)
        ids = self.tokenizer(params["prompt"]).input_ids
        req_id = f"cmpl-{uuid.uuid4().hex}"
        loop = asyncio.get_running_loop()
        if not params["stream"]:
            out = await loop.run_in_executor(None, self._generate, ids, params, None)
            return {
                "id": req_id,
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.served_name,
                "choices": [
                    {
                        "index": 0,
                        "text": self.tokenizer.decode(out, skip_special_tokens=True),
                        "logprobs": None,
                        "finish_reason": self._finish_reason(out, params["max_tokens"]),
                    }
                ],
                "usage": _usage(len(ids), len(out)),
            }
        return self._stream(req_id, ids, params, loop)

    async def _stream(
        self, req_id: str, ids: list[int], params: dict[str, Any], loop: asyncio.AbstractEventLoop
    ) -> AsyncIterator[str]:
        queue: asyncio.Queue[Any] = asyncio.Queue()
        streamer = TokenQueueStreamer(loop, queue, self.token_delay_s)
        loop.run_in_executor(None, self._generate_into, ids, params, streamer)
        created = int(time.time())
        out: list[int] = []
        sent = ""
        while True:
            item = await queue.get()
            if isinstance(item, _Done) and item.error is not None:
                # Reported in the stream, as OpenAI does once the 200 has gone out.
                yield f"data: {json.dumps({'error': {'message': item.error, 'code': 500}})}\n\n"
                yield "data: [DONE]\n\n"
                return
            if isinstance(item, _Done):
                break
            out.append(item)
            text = self.tokenizer.decode(out, skip_special_tokens=True)
            # Hold back a partial UTF-8 character until its last byte arrives.
            delta = "" if text.endswith("\ufffd") else text[len(sent) :]
            sent += delta
            choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": None}
            yield self._chunk(req_id, created, [choice])
        reason = self._finish_reason(out, params["max_tokens"])
        last = {"index": 0, "text": "", "logprobs": None, "finish_reason": reason}
        yield self._chunk(req_id, created, [last])
        if params["include_usage"]:
            yield self._chunk(req_id, created, [], usage=_usage(len(ids), len(out)))
        yield "data: [DONE]\n\n"


def _params(body: dict[str, Any]) -> dict[str, Any]:
    """The request fields the baseline honours; raises ValueError naming a bad one."""
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ValueError("prompt must be a non-empty string")
    max_tokens = body.get("max_tokens", 16)
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    temperature = body.get("temperature", 1.0)
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature!r}")
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": float(temperature),
        "ignore_eos": bool(body.get("ignore_eos", False)),
        "stream": bool(body.get("stream", False)),
        "include_usage": bool((body.get("stream_options") or {}).get("include_usage")),
    }


def _usage(num_prompt: int, num_completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
    }


api = FastAPI()


@serve.deployment
@serve.ingress(api)
class Replica(HFCompletions):
    @api.get("/ready")
    async def ready(self) -> Response:
        return JSONResponse({"ready": True})

    @api.get("/v1/models")
    async def models(self) -> Response:
        card = {"id": self.served_name, "object": "model", "owned_by": "ray-hf-baseline"}
        return JSONResponse({"object": "list", "data": [card]})

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        body = await request.json()
        if body.get("model") not in (None, self.served_name):
            return JSONResponse({"error": {"message": "no such model", "code": 404}}, 404)
        try:
            result = await self.complete(body)
        except ValueError as e:
            return JSONResponse({"error": {"message": str(e), "code": 400}}, 400)
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream")


def build_app(args: argparse.Namespace, model_path: str, served_name: str) -> Any:
    """The Ray Serve application: one `Replica` deployment behind its FastAPI ingress."""
    # `serve.deployment` turns the class into a Deployment; its stubs do not say so.
    deployment = Replica.options(  # type: ignore[attr-defined]
        num_replicas=args.num_replicas,
        max_ongoing_requests=args.max_ongoing_requests,
        ray_actor_options={"num_cpus": args.num_cpus / args.num_replicas},
    )
    return deployment.bind(model_path, served_name, args.num_threads, args.token_delay_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cli_args(parser)
    args = parser.parse_args(argv)
    if args.num_replicas < 1 or args.max_ongoing_requests < 1:
        raise ValueError("--num-replicas and --max-ongoing-requests must be >= 1")
    if args.token_delay_s < 0:
        raise ValueError(f"--token-delay-s must be >= 0, got {args.token_delay_s}")
    from fleetserve.models.default_model import default_model_path

    model_path = os.path.abspath(args.model or default_model_path())
    served_name = args.served_model_name or os.path.basename(model_path).removesuffix(".gguf")
    import ray

    # Not this file's __main__ copy: replicas must find the deployment by module name.
    from fleetserve.bench.ray_hf_baseline import build_app

    ray.init(
        address="local",
        num_cpus=args.num_cpus,
        include_dashboard=False,
        object_store_memory=args.object_store_mb * 2**20,
        _node_ip_address="127.0.0.1",
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        serve.run(build_app(args, model_path, served_name), name="hf", route_prefix="/")
        print(f"ray-hf-baseline: ready on http://127.0.0.1:{args.port} ({served_name})", flush=True)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
