"""`fleetserve bench rag` (issue 23, item 4a): a retrieval-augmented answer as a `custom`
handler that calls two models of the fleet through the fleet client (embed the question
with all-MiniLM-L6-v2, take the nearest shipped documents, answer with a chat model),
against the same calls made by hand from a client, alternated, on one local server.

    fleetserve bench rag --model CHAT.gguf [--requests 24] [--max-tokens 8] [--top-k 2] [--ray]

`--ray`: the same fleet file through `fleetserve serve --ray` (a local Ray started for the
run; the handler's sub-calls go through the ingress's deployment handle, ray/fleet_client.py).

The by-hand side does the same work: the documents embedded once up front (as the handler
does on its first call), then per question one embeddings call, the same top-k and the
same chat body. Overhead per hop = (median pipeline - median by hand) / 2 sub-calls.
"""

from __future__ import annotations

import argparse
import statistics
import time
from importlib import resources
from typing import Any

import httpx

from fleetserve.bench.local_server import serve_fleet_file

FLEET = """
models:
  - name: chat
    model: {model}
    engine: {{max_num_seqs: 2, max_model_len: 1024}}{place_chat}
  - name: minilm
    kind: embed{place_embed}
  - name: rag
    kind: custom
    handler: fleetserve.bench.rag_handler:RagAnswer
    options: {{embed_model: minilm, chat_model: chat, max_tokens: {max_tokens}, top_k: {top_k}}}
    timeout_s: 120.0
    batching: {{max_batch_size: 1, batch_wait_timeout_s: 0.0}}{place_rag}
"""


def _placement(ray: bool) -> dict[str, str]:
    """On Ray, CPUs per replica that fit a 2-CPU machine (the local server takes none)."""
    cpus = {"place_chat": 1, "place_embed": 0.5, "place_rag": 0.25}
    return {k: f"\n    placement: {{num_cpus: {v}}}" if ray else "" for k, v in cpus.items()}


def _lines(name: str) -> list[str]:
    text = resources.files("fleetserve.bench").joinpath(f"data/{name}").read_text()
    return [x.strip() for x in text.splitlines() if x.strip()]


def documents() -> list[str]:
    return _lines("rag_docs.txt")


def questions() -> list[str]:
    return _lines("rag_questions.txt")


def top_k(query: list[float], docs: list[list[float]], k: int) -> list[int]:
    """Indices of the k documents of highest dot product (MiniLM's vectors are unit-norm),
    ties to the earlier document."""
    scores = [sum(a * b for a, b in zip(query, d, strict=True)) for d in docs]
    return sorted(range(len(docs)), key=lambda i: (-scores[i], i))[:k]


def chat_body(model: str, question: str, context: list[str], max_tokens: int) -> dict[str, Any]:
    system = "Answer from the context.\nContext:\n" + "\n".join(context)
    return {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
    }


def _by_hand(c: httpx.Client, q: str, docs: list[str], vecs: list[list[float]], args: Any) -> str:
    vec = c.post("/v1/embeddings", json={"model": "minilm", "input": q}).json()
    ctx = [docs[i] for i in top_k(vec["data"][0]["embedding"], vecs, args.top_k)]
    out: Any = c.post("/v1/chat/completions", json=chat_body("chat", q, ctx, args.max_tokens))
    return str(out.json()["choices"][0]["message"]["content"])


def _pipeline(c: httpx.Client, q: str) -> str:
    r = c.post("/v1/models/rag:predict", json={"instances": [{"question": q}]})
    r.raise_for_status()
    return str(r.json()["predictions"][0]["answer"])


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="the chat model (HF folder or GGUF)")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--ray", action="store_true", help="serve the fleet with `serve --ray`")


def run(args: argparse.Namespace) -> int:
    fleet = FLEET.format(
        model=args.model, max_tokens=args.max_tokens, top_k=args.top_k, **_placement(args.ray)
    )
    server = serve_fleet_file(fleet, "rag-bench", *(["--ray"] if args.ray else []))
    try:
        return measure(server.url, args)
    finally:
        server.stop()


def _first_embeddings(c: httpx.Client, docs: list[str]) -> Any:
    """The documents' vectors; retried while the fleet still loads (on Ray the front door
    answers before every model's replica does)."""
    deadline = time.monotonic() + 300.0
    while True:
        r = c.post("/v1/embeddings", json={"model": "minilm", "input": docs})
        if r.status_code == 200 or time.monotonic() > deadline:
            r.raise_for_status()
            return r.json()
        time.sleep(1.0)


def measure(url: str, args: argparse.Namespace) -> int:
    """Times the pipeline against the same calls by hand on the server at `url`."""
    docs, qs = documents(), questions()
    times: dict[str, list[float]] = {"by hand": [], "pipeline": []}
    with httpx.Client(base_url=url, timeout=300) as c:
        body = _first_embeddings(c, docs)
        vecs = [d["embedding"] for d in body["data"]]
        for q in qs:  # warm both paths; the answers must agree
            a, b = _pipeline(c, q), _by_hand(c, q, docs, vecs, args)
            if a != b:
                print(f"answers differ on {q!r}: pipeline {a!r} vs by hand {b!r}")
                return 1
        for i in range(args.requests):
            q = qs[i % len(qs)]
            for name in ("pipeline", "by hand") if i % 2 else ("by hand", "pipeline"):
                start = time.perf_counter()
                _pipeline(c, q) if name == "pipeline" else _by_hand(c, q, docs, vecs, args)
                times[name].append((time.perf_counter() - start) * 1e3)
    for name, xs in times.items():
        p90 = sorted(xs)[min(len(xs) - 1, int(0.9 * len(xs)))]
        print(f"{name:8s} median {statistics.median(xs):8.2f} ms  p90 {p90:8.2f} ms")
    diff = statistics.median(times["pipeline"]) - statistics.median(times["by hand"])
    print(f"overhead per hop (median difference / 2 sub-calls): {diff / 2:+.2f} ms")
    print(f"served by: {'serve --ray (Ray Serve)' if args.ray else 'serve (local)'}")
    return 0
