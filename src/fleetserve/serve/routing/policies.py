"""Routing policies (`--routing`): round_robin, least_loaded, prefix_affinity, power_of_two."""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence

from fleetserve.core.block_manager import BlockHash, hash_block
from fleetserve.serve.contracts import R, RouteRequest, RoutingPolicy, load_key

POLICY_NAMES = ("round_robin", "least_loaded", "prefix_affinity", "power_of_two")


class RoundRobin(RoutingPolicy):
    """Replicas in index order, skipping those that are not candidates right now."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next_index = 0

    def choose(self, request: RouteRequest, candidates: Sequence[R]) -> R:
        pick = next((c for c in candidates if c.index >= self._next_index), candidates[0])
        self._next_index = pick.index + 1
        return pick


class LeastLoaded(RoutingPolicy):
    """Fewest outstanding tokens (prompt tokens not yet prefilled + tokens still to generate)."""

    name = "least_loaded"

    def choose(self, request: RouteRequest, candidates: Sequence[R]) -> R:
        return min(candidates, key=load_key)


class PowerOfTwo(RoutingPolicy):
    """Two distinct random candidates, the less loaded of them; seeded, so reproducible."""

    name = "power_of_two"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, request: RouteRequest, candidates: Sequence[R]) -> R:
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(list(candidates), 2)
        return a if load_key(a) <= load_key(b) else b


class PrefixAffinity(RoutingPolicy):
    """Requests that share a prompt prefix go to the replica that already holds it.

    The prompt's leading full blocks are hashed into a chain the way the BlockManager
    does it (each hash covers the whole prefix up to its block), and a bounded LRU map
    remembers which replica was last sent each chain hash. The request goes to the
    candidate owning its longest remembered chain, unless that replica's outstanding
    tokens exceed the least-loaded candidate's by more than `imbalance_tokens`; then, or
    with no match, it goes to the least-loaded one. Either way the chosen replica becomes
    the owner of every block of the prompt, since it is about to cache them.
    """

    name = "prefix_affinity"

    def __init__(
        self, block_size: int, imbalance_tokens: int = 2048, max_entries: int = 1 << 16
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if imbalance_tokens < 0:
            raise ValueError(f"imbalance_tokens must be >= 0, got {imbalance_tokens}")
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.block_size = block_size
        self.imbalance_tokens = imbalance_tokens
        self.max_entries = max_entries
        self._owner: OrderedDict[BlockHash, int] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._owner)

    def block_hashes(self, token_ids: Sequence[int]) -> list[BlockHash]:
        bs = self.block_size
        hashes: list[BlockHash] = []
        for start in range(0, len(token_ids) - bs + 1, bs):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, tuple(token_ids[start : start + bs])))
        return hashes

    def choose(self, request: RouteRequest, candidates: Sequence[R]) -> R:
        hashes = self.block_hashes(request.prompt_token_ids)
        by_index = {c.index: c for c in candidates}
        least = min(candidates, key=load_key)
        chosen = least
        for h in reversed(hashes):  # the longest chain first
            owner_index = self._owner.get(h)
            owner = by_index.get(owner_index) if owner_index is not None else None
            if owner is None:
                continue
            excess = owner.num_outstanding_tokens - least.num_outstanding_tokens
            if excess <= self.imbalance_tokens:
                chosen = owner
            break
        for h in hashes:
            self._owner[h] = chosen.index
            self._owner.move_to_end(h)
        while len(self._owner) > self.max_entries:
            self._owner.popitem(last=False)
        return chosen

    def owner_of(self, token_ids: Sequence[int]) -> int | None:
        """The replica remembered for the longest chain of `token_ids` (for tests, metrics)."""
        for h in reversed(self.block_hashes(token_ids)):
            if h in self._owner:
                return self._owner[h]
        return None


def make_policy(
    name: str, *, block_size: int = 16, seed: int = 0, imbalance_tokens: int = 2048
) -> RoutingPolicy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    if name == "prefix_affinity":
        return PrefixAffinity(block_size, imbalance_tokens)
    if name == "power_of_two":
        return PowerOfTwo(seed)
    raise ValueError(f"routing must be one of {', '.join(POLICY_NAMES)}; got {name!r}")
