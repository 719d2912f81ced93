"""Sliding-window block release: exact block ids, placeholders, prefix hits, two pools.

Window W = 6 tokens, block_size 4: a query at position p sees keys p - 5 .. p, so once
num_computed_tokens = c, the blocks wholly before key c - 5 are dead:
(c - 5) // 4 of them.
"""

from __future__ import annotations

from fleetserve.core.block_manager import BlockManager
from fleetserve.core.hybrid_blocks import HybridBlockManager
from fleetserve.core.request import Request
from fleetserve.core.sampling_params import SamplingParams

BS, W = 4, 6


def make_req(req_id: str, token_ids: list[int]) -> Request:
    return Request(req_id, token_ids, SamplingParams(max_tokens=8))


def step(bm: BlockManager, req: Request, num_new: int) -> list[int]:
    """Allocate `num_new` tokens' slots, then mark them computed (one step)."""
    assert bm.allocate_slots(req, num_new)
    bm.check_invariants()
    req.num_computed_tokens += num_new
    bm.cache_full_blocks(req)
    bm.check_invariants()
    return bm.block_ids(req.req_id)


def test_blocks_that_slide_out_are_released_in_order() -> None:
    bm = BlockManager(8, BS, sliding_window=W)
    req = make_req("a", list(range(24)))
    assert step(bm, req, 8) == [0, 1]  # nothing dead before computing
    assert bm.req_num_released.get("a", 0) == 0
    # c = 8: keys >= 3 are visible: block 0 (keys 0-3) still is.
    assert step(bm, req, 4) == [0, 1, 2]
    assert bm.req_num_released.get("a", 0) == 0
    # c = 12: keys >= 7 visible: block 0 is dead, released at the next allocation.
    assert step(bm, req, 4) == [0, 1, 2, 3]
    assert bm.req_num_released["a"] == 1
    assert bm.blocks[0].ref_cnt == 0
    # Block 0 held computed, cached tokens: it goes to the tail of the free queue (LRU),
    # behind the never-used blocks.
    assert list(bm.free_queue) == [4, 5, 6, 7, 0]
    # c = 16: keys >= 11 visible: blocks 0 and 1 dead.
    step(bm, req, 4)
    assert bm.req_num_released["a"] == 2
    assert list(bm.free_queue) == [5, 6, 7, 0, 1]
    bm.free(req)
    bm.check_invariants()
    assert bm.num_free_blocks == 8


def test_window_prefix_hit_needs_only_the_window_blocks() -> None:
    bm = BlockManager(10, BS, sliding_window=W)
    a = make_req("a", list(range(20)))
    step(bm, a, 16)
    step(bm, a, 4)  # releases blocks 0, 1 (c = 16 at this allocation)
    bm.free(a)
    # Evict block 0's content: take every free block ahead of it, and give them back.
    filler = make_req("f", list(range(500, 500 + 4 * 6)))
    assert bm.allocate_slots(filler, 24)
    taken = bm.block_ids("f")
    assert 0 in taken and bm.blocks[0].block_hash is None
    bm.free(filler)
    bm.check_invariants()
    # Same 17-token prefix: 4 full blocks could hit; with block 0 gone a plain cache would
    # hit nothing, the window needs only blocks 2, 3 (c = 16: keys >= 11).
    b = make_req("b", list(range(16)) + [99])
    hits, num_hit_tokens = bm.get_computed_blocks(b)
    assert num_hit_tokens == 16
    assert hits[2:] == a_blocks_2_3(bm, a)
    assert bm.allocate_slots(b, 1, hits)
    bm.check_invariants()
    assert bm.req_num_released["b"] == 2
    assert [bm.blocks[x].ref_cnt for x in hits[2:]] == [1, 1]


def a_blocks_2_3(bm: BlockManager, a: Request) -> list[int]:
    return [bm.cached[a.block_hashes[2]], bm.cached[a.block_hashes[3]]]


def test_hybrid_pools_allocate_together_and_bound_the_window_pool() -> None:
    bm = HybridBlockManager(12, 5, BS, W)
    req = make_req("a", list(range(40)))
    for _ in range(9):
        step(bm, req, 4)
    # 36 tokens: the global pool holds all 9 blocks; the window pool only the live ones
    # (c = 32 at the last allocation: keys >= 27, blocks 6..8).
    assert bm.block_ids("a") == list(range(9))
    assert bm.sliding.req_num_released["a"] == 6
    assert len(bm.sliding._held("a")) == 3
    assert bm.sliding.num_free_blocks == 2
    # The window pool never held more than 3 + 1 blocks at once though 9 were written.
    bm.free(req)
    bm.check_invariants()
    assert bm.num_free_blocks == 12 and bm.sliding.num_free_blocks == 5


def test_hybrid_refuses_when_either_pool_is_short() -> None:
    bm = HybridBlockManager(12, 2, BS, W)
    req = make_req("a", list(range(40)))
    # 12 tokens need 3 blocks now in both pools; the window pool has 2: nothing changes.
    assert not bm.allocate_slots(req, 12)
    assert bm.num_free_blocks == 12 and bm.sliding.num_free_blocks == 2
    assert bm.block_ids("a") == [] and bm.sliding.block_ids("a") == []
