"""What a graph's composition costs (issue 23, item 4a): a two-step graph (embed the
question with all-MiniLM-L6-v2, then answer it with a generate model, the vector's first
value as "context") through `/v1/chat/completions` on a graph, against the same two calls
made by hand from a client, alternated, on one local server.

    python -m fleetserve.bench.graph_overhead --model PATH [--requests 40] [--max-tokens 8]

Prints the median and p90 latency of each and the overhead per hop ((graph - by hand) / 2
hops, the client's two round trips included on the by-hand side).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import httpx

from fleetserve.bench.fleet_entries import embed_entry, fleet_file, generate_entry, rag_graph_entry
from fleetserve.bench.local_server import serve_fleet_file


def fleet(model: str, max_tokens: int) -> str:
    """The bench's fleet file: a generate model, the embedder and the graph over them."""
    return fleet_file(
        [
            generate_entry("chat", model, max_num_seqs=4, max_model_len=512),
            embed_entry(),
            rag_graph_entry("rag", embedder="minilm", chat="chat", max_tokens=max_tokens),
        ]
    )


QUESTIONS = ["Where is the moon?", "What is a river?", "Name a red fruit.", "Why is ice cold?"]


def _by_hand(c: httpx.Client, question: str, max_tokens: int) -> str:
    vec = c.post("/v1/embeddings", json={"model": "minilm", "input": question}).json()
    system = {"role": "system", "content": f"Context: {vec['data'][0]['embedding'][0]}"}
    body = {"model": "chat", "max_tokens": max_tokens, "temperature": 0.0,
            "messages": [system, {"role": "user", "content": question}]}  # fmt: skip
    out: Any = c.post("/v1/chat/completions", json=body).json()
    return str(out["choices"][0]["message"]["content"])


def _graph(c: httpx.Client, question: str) -> str:
    body = {"model": "rag", "messages": [{"role": "user", "content": question}]}
    out: Any = c.post("/v1/chat/completions", json=body).json()
    return str(out["choices"][0]["message"]["content"])


def _pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a generate model (HF folder or GGUF)")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args(argv)
    server = serve_fleet_file(fleet(args.model, args.max_tokens), "graph-bench")
    try:
        times: dict[str, list[float]] = {"by hand": [], "graph": []}
        with httpx.Client(base_url=server.url, timeout=120) as c:
            for q in QUESTIONS:  # warm both paths; the answers must agree
                assert _graph(c, q) == _by_hand(c, q, args.max_tokens), q
            for i in range(args.requests):
                q = QUESTIONS[i % len(QUESTIONS)]
                for name in ("graph", "by hand") if i % 2 else ("by hand", "graph"):
                    start = time.perf_counter()
                    _graph(c, q) if name == "graph" else _by_hand(c, q, args.max_tokens)
                    times[name].append((time.perf_counter() - start) * 1e3)
        for name, xs in times.items():
            print(f"{name:8s} median {statistics.median(xs):7.2f} ms  p90 {_pct(xs, 0.9):7.2f} ms")
        diff = statistics.median(times["graph"]) - statistics.median(times["by hand"])
        print(f"overhead per hop (median difference / 2): {diff / 2:+.2f} ms")
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
