"""Seeded synthetic workloads shared by the offline benchmark and its peers.

``default_workload(seed=0)`` reproduces ../shared/bench/workload.json exactly (the file
the peers were measured on): per request, prompt length, output length, then the
prompt's token ids, all drawn from Python's ``random`` seeded once.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def default_workload(
    num_requests: int = 64,
    seed: int = 0,
    prompt_len: tuple[int, int] = (32, 512),
    output_len: tuple[int, int] = (16, 256),
    token_range: tuple[int, int] = (4, 31999),
) -> list[BenchRequest]:
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        p = rng.randint(*prompt_len)
        o = rng.randint(*output_len)
        ids = [rng.randint(*token_range) for _ in range(p)]
        out.append(BenchRequest(ids, o))
    return out


def shared_prefix_workload(
    num_requests: int = 64,
    seed: int = 0,
    prefix_len: int = 1024,
    suffix_len: tuple[int, int] = (16, 64),
    output_len: int = 16,
    token_range: tuple[int, int] = (4, 31999),
) -> list[BenchRequest]:
    """Many requests behind one long system prompt (the prefix cache's best case)."""
    rng = random.Random(seed)
    prefix = [rng.randint(*token_range) for _ in range(prefix_len)]
    out = []
    for _ in range(num_requests):
        suffix = [rng.randint(*token_range) for _ in range(rng.randint(*suffix_len))]
        out.append(BenchRequest(prefix + suffix, output_len))
    return out


def load_workload(path: str) -> list[BenchRequest]:
    """A JSON file shaped like ../shared/bench/workload.json."""
    with open(path) as f:
        data = json.load(f)
    reqs = data["requests"] if isinstance(data, dict) else data
    return [BenchRequest(list(r["prompt_token_ids"]), int(r["output_len"])) for r in reqs]
