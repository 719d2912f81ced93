"""Adapter-aware routing: a LoRA request goes where its adapter already is.

Among the router's candidates, those that hold the request's adapter (loaded, or being
loaded for a request sent there) are preferred as long as their outstanding tokens exceed
the least-loaded candidate's by at most `imbalance_tokens` (the bound prefix_affinity
uses); the model's policy then picks among them. When no candidate holds it, or every
holder is too far behind, the request goes to the least-loaded candidate, which loads
the adapter. Base-model requests are not narrowed.
"""

from __future__ import annotations

from collections.abc import Sequence

from fleetserve.serve.contracts import R, RouteRequest, load_key


def held_adapters(replica: object) -> frozenset[str]:
    """The adapters a replica holds; a load-figures object without them holds none."""
    names = getattr(replica, "lora_names", None)
    return names if isinstance(names, frozenset) else frozenset()


def adapter_candidates(
    request: RouteRequest, candidates: Sequence[R], imbalance_tokens: int
) -> list[R]:
    if request.lora_name is None or not candidates:
        return list(candidates)
    least = min(candidates, key=load_key)
    holders = [
        c
        for c in candidates
        if request.lora_name in held_adapters(c)
        and c.num_outstanding_tokens - least.num_outstanding_tokens <= imbalance_tokens
    ]
    return holders or [least]
