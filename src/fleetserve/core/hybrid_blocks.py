"""Block bookkeeping for a model with global and sliding-window layers (Gemma 3).

Two pools of blocks, each with its own free queue and prefix cache: this manager is the
global layers' (every token's K/V is kept), and ``sliding`` is the local layers' (a
`BlockManager` with a window, which releases the blocks that slide out of it). A request
holds one block list in each; the runner gets both (``window_block_ids``) and the local
layers' caches are sized for the sliding pool only, so a long conversation's K/V in
those layers stays bounded by its window (``sliding_window`` None keeps every block: the
A/B baseline, `CacheConfig.free_window_blocks=False`).

Every allocation goes to both pools or to neither; a prefix-cache hit counts only as far
as both pools can serve it (all blocks of the global pool, the window's blocks of the
sliding one).
"""

from __future__ import annotations

from fleetserve.core.block_manager import BlockManager
from fleetserve.core.request import Request


class HybridBlockManager(BlockManager):
    def __init__(
        self,
        num_blocks: int,
        num_sliding_blocks: int,
        block_size: int,
        sliding_window: int | None,
        enable_prefix_caching: bool = True,
    ) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        self.sliding = BlockManager(
            num_sliding_blocks, block_size, enable_prefix_caching, sliding_window
        )

    # ----------------------------------------------------------------- queries
    @property
    def num_total_blocks(self) -> int:
        return self.num_blocks + self.sliding.num_blocks

    @property
    def num_total_free_blocks(self) -> int:
        return self.num_free_blocks + self.sliding.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.num_total_free_blocks / self.num_total_blocks

    def window_block_ids(self, req_id: str) -> list[int] | None:
        return self.sliding.block_ids(req_id)

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        hits, _ = super().get_computed_blocks(request)
        if hits:
            num = len(self.sliding.window_hits(request, len(hits)))
            hits = hits[:num]
        return hits, len(hits) * self.block_size

    # ------------------------------------------------------------- allocation
    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[int] | None = None
    ) -> bool:
        computed_blocks = computed_blocks or []
        # The sliding pool's part of the same hit (its window's blocks).
        window_hits = (
            self.sliding.window_hits(request, len(computed_blocks)) if computed_blocks else []
        )
        assert len(window_hits) == len(computed_blocks), "hit not served by both pools"
        self.sliding.release_out_of_window(request)
        if not self._fits(self.sliding, request, num_new_tokens, window_hits):
            return False
        if not super().allocate_slots(request, num_new_tokens, computed_blocks):
            return False
        ok = self.sliding.allocate_slots(request, num_new_tokens, window_hits)
        assert ok, "checked above"
        return True

    @staticmethod
    def _fits(bm: BlockManager, request: Request, num_new: int, hits: list[int]) -> bool:
        held = bm.block_ids(request.req_id)
        total = bm.blocks_needed(request.num_computed_tokens + len(hits) * bm.block_size + num_new)
        live = hits[bm._num_dead(len(hits) * bm.block_size) :]
        taken_free = sum(1 for b in live if bm.blocks[b].ref_cnt == 0)
        return total - len(held) - len(hits) + taken_free <= bm.num_free_blocks

    def cache_full_blocks(self, request: Request) -> None:
        super().cache_full_blocks(request)
        self.sliding.cache_full_blocks(request)

    def free_tail(self, request: Request, num_tokens: int) -> int:
        n = super().free_tail(request, num_tokens)
        self.sliding.free_tail(request, num_tokens)
        return n

    def free(self, request: Request) -> None:
        super().free(request)
        self.sliding.free(request)

    def reset_prefix_cache(self) -> None:
        super().reset_prefix_cache()
        self.sliding.reset_prefix_cache()

    def check_invariants(self) -> None:
        super().check_invariants()
        self.sliding.check_invariants()
        assert set(self.req_to_blocks) == set(self.sliding.req_to_blocks), "pools disagree"
