"""BlockManager: exact block ids, reference counts and LRU eviction order.

Every test uses block_size 4 and checks the manager's invariants after each operation.
Token ids are small distinct ranges so that equal prefixes are easy to read.
"""

from __future__ import annotations

import pytest

from fleetserve.core.block_manager import BlockManager
from fleetserve.core.request import Request
from fleetserve.core.sampling_params import SamplingParams

BS = 4


def make_req(req_id: str, token_ids: list[int], **params: object) -> Request:
    return Request(req_id, token_ids, SamplingParams(max_tokens=8, **params))


def free_order(bm: BlockManager) -> list[int]:
    """Block ids in the order new allocations will take them."""
    return list(bm.free_queue)


def refs(bm: BlockManager, block_ids: list[int]) -> list[int]:
    return [bm.blocks[b].ref_cnt for b in block_ids]


def admit(bm: BlockManager, req: Request, num_new: int | None = None) -> list[int]:
    """Look up prefix hits, allocate, mark everything computed and cache full blocks,
    as the scheduler and one finished step would."""
    hits, num_hit_tokens = bm.get_computed_blocks(req)
    num_new = req.num_tokens - num_hit_tokens if num_new is None else num_new
    assert bm.allocate_slots(req, num_new, hits)
    bm.check_invariants()
    req.num_computed_tokens = num_hit_tokens + num_new
    bm.cache_full_blocks(req)
    bm.check_invariants()
    return bm.block_ids(req.req_id)


def snapshot(bm: BlockManager) -> tuple:
    return (
        free_order(bm),
        [(b.ref_cnt, b.block_hash) for b in bm.blocks],
        dict(bm.cached),
        {k: list(v) for k, v in bm.req_to_blocks.items()},
        dict(bm.req_num_hashed),
    )


def test_allocation_takes_blocks_from_the_head_of_the_free_queue() -> None:
    bm = BlockManager(8, BS)
    a = make_req("a", list(range(10)))  # 10 tokens -> 3 blocks
    assert admit(bm, a) == [0, 1, 2]
    assert refs(bm, [0, 1, 2]) == [1, 1, 1]
    assert free_order(bm) == [3, 4, 5, 6, 7]
    b = make_req("b", list(range(100, 105)))
    assert admit(bm, b) == [3, 4]
    assert bm.num_free_blocks == 3
    assert bm.usage == pytest.approx(5 / 8)


def test_growing_a_request_appends_blocks_only_at_block_boundaries() -> None:
    bm = BlockManager(8, BS)
    a = make_req("a", list(range(6)))
    assert admit(bm, a) == [0, 1]
    # Decode steps: token 7 and 8 fit in block 1; token 9 needs block 2.
    for tok, expected in ((6, [0, 1]), (7, [0, 1]), (8, [0, 1, 2])):
        a.append_token(tok)
        assert bm.allocate_slots(a, 1)
        a.num_computed_tokens += 1
        bm.cache_full_blocks(a)
        bm.check_invariants()
        assert bm.block_ids("a") == expected
    # Blocks 0 and 1 are full of computed tokens now; block 2 is not.
    assert bm.blocks[0].block_hash is not None
    assert bm.blocks[1].block_hash is not None
    assert bm.blocks[2].block_hash is None


def test_prefix_hit_shares_full_blocks_and_counts_references() -> None:
    bm = BlockManager(8, BS)
    prefix = list(range(8))  # exactly 2 full blocks
    a = make_req("a", prefix + [50, 51])
    assert admit(bm, a) == [0, 1, 2]
    b = make_req("b", prefix + [60, 61, 62])
    hits, num_hit_tokens = bm.get_computed_blocks(b)
    assert (hits, num_hit_tokens) == ([0, 1], 8)
    assert bm.allocate_slots(b, b.num_tokens - 8, hits)
    bm.check_invariants()
    assert bm.block_ids("b") == [0, 1, 3]
    assert refs(bm, [0, 1, 2, 3]) == [2, 2, 1, 1]
    # A lookup alone counts nothing: the scheduler records each admitted request once.
    assert bm.num_hit_tokens == 0 and bm.num_queried_tokens == 0
    bm.record_lookup(b.num_tokens, num_hit_tokens)
    assert bm.hit_rate == 8 / b.num_tokens


def test_partial_last_block_is_never_shared() -> None:
    bm = BlockManager(8, BS)
    a = make_req("a", list(range(10)))  # blocks [0..3] [4..7] [8, 9]
    admit(bm, a)
    assert bm.blocks[2].block_hash is None
    # b agrees with a on all 10 tokens and more; its third block would only match a's
    # partial block, which holds no hash.
    b = make_req("b", list(range(10)) + [10, 11, 12])
    hits, n = bm.get_computed_blocks(b)
    assert (hits, n) == ([0, 1], 8)


def test_at_least_one_token_is_left_to_compute() -> None:
    bm = BlockManager(8, BS)
    a = make_req("a", list(range(12)))
    admit(bm, a)
    assert all(bm.blocks[b].block_hash is not None for b in (0, 1, 2))
    # Exactly 2 full blocks, both cached: only the first one may hit, since the last
    # token must run through the model to give logits.
    b = make_req("b", list(range(8)))
    hits, n = bm.get_computed_blocks(b)
    assert (hits, n) == ([0], 4)
    assert bm.allocate_slots(b, 4, hits)
    bm.check_invariants()
    assert bm.block_ids("b") == [0, 3]
    # One token past the boundary: both blocks hit.
    c = make_req("c", list(range(9)))
    assert bm.get_computed_blocks(c) == ([0, 1], 8)


def test_prompt_logprobs_disable_prefix_hits() -> None:
    bm = BlockManager(8, BS)
    admit(bm, make_req("a", list(range(10))))
    b = make_req("b", list(range(10)), prompt_logprobs=1)
    assert bm.get_computed_blocks(b) == ([], 0)


def test_freed_cached_blocks_stay_hittable_until_evicted() -> None:
    bm = BlockManager(6, BS)
    a = make_req("a", list(range(10)))
    assert admit(bm, a) == [0, 1, 2]
    bm.free(a)
    bm.check_invariants()
    assert refs(bm, [0, 1, 2]) == [0, 0, 0]
    assert bm.num_free_blocks == 6
    # The uncached partial block goes first, then never-used blocks, then the cached
    # blocks tail first.
    assert free_order(bm) == [2, 3, 4, 5, 1, 0]
    b = make_req("b", list(range(8)) + [70])
    assert admit(bm, b) == [0, 1, 2]
    assert refs(bm, [0, 1, 2]) == [1, 1, 1]
    assert free_order(bm) == [3, 4, 5]


def test_lru_eviction_order_and_tail_before_head() -> None:
    bm = BlockManager(6, BS)
    a = make_req("a", list(range(8)) + [90])  # 2 full blocks + 1 partial
    b = make_req("b", list(range(100, 108)) + [91])
    assert admit(bm, a) == [0, 1, 2]
    assert admit(bm, b) == [3, 4, 5]
    bm.free(a)  # freed first: least recently used
    bm.free(b)
    bm.check_invariants()
    assert free_order(bm) == [5, 2, 1, 0, 4, 3]

    # A 2-block request takes the two uncached blocks; nothing is evicted.
    c = make_req("c", list(range(200, 207)))
    assert admit(bm, c) == [5, 2]
    assert sorted(bm.cached.values()) == [0, 1, 3, 4, 5]  # c's own full block is 5
    # The next block evicts a's tail block 1; a's head block 0 still hits.
    d = make_req("d", list(range(300, 303)))
    assert admit(bm, d) == [1]
    assert bm.blocks[1].block_hash is None
    assert bm.get_computed_blocks(make_req("a2", list(range(8)) + [90])) == ([0], 4)
    assert bm.get_computed_blocks(make_req("b2", list(range(100, 108)) + [91])) == ([3, 4], 8)
    # Then a's head block 0, then b's tail 4, then b's head 3.
    e = make_req("e", list(range(400, 411)))
    assert admit(bm, e) == [0, 4, 3]
    assert bm.num_free_blocks == 0
    assert bm.get_computed_blocks(make_req("a3", list(range(8)) + [90])) == ([], 0)
    assert bm.get_computed_blocks(make_req("b3", list(range(100, 108)) + [91])) == ([], 0)


def test_reused_hit_block_moves_to_the_back_of_the_lru() -> None:
    bm = BlockManager(4, BS)
    a = make_req("a", list(range(4)) + [9])
    b = make_req("b", list(range(10, 14)) + [9])
    assert admit(bm, a) == [0, 1]
    assert admit(bm, b) == [2, 3]
    bm.free(a)
    bm.free(b)
    assert free_order(bm) == [3, 1, 0, 2]
    # Hitting a's block 0 again and freeing it makes it the most recently used.
    a2 = make_req("a2", list(range(4)) + [8])
    assert admit(bm, a2) == [0, 3]
    bm.free(a2)
    bm.check_invariants()
    assert free_order(bm) == [3, 1, 2, 0]


def test_uncached_freed_blocks_are_reused_before_cached_ones() -> None:
    bm = BlockManager(4, BS)
    a = make_req("a", list(range(8)))  # 2 full blocks, both cached
    b = make_req("b", [50, 51])  # 1 partial block, never cached
    assert admit(bm, a) == [0, 1]
    assert admit(bm, b) == [2]
    bm.free(a)
    bm.free(b)  # freed last, but worthless: it goes to the head
    bm.check_invariants()
    assert free_order(bm) == [2, 3, 1, 0]
    c = make_req("c", [60, 61, 62, 63, 64])
    assert admit(bm, c) == [2, 3]
    assert bm.get_computed_blocks(make_req("a2", list(range(8)) + [1])) == ([0, 1], 8)


def test_duplicate_content_keeps_one_cache_entry() -> None:
    """Two requests that compute the same block at once: the first one is cached, the
    second copy is freed as uncached."""
    bm = BlockManager(6, BS)
    a = make_req("a", list(range(5)))
    b = make_req("b", list(range(5)))
    assert bm.allocate_slots(a, 5) and bm.allocate_slots(b, 5)
    a.num_computed_tokens = b.num_computed_tokens = 5
    bm.cache_full_blocks(a)
    bm.cache_full_blocks(b)
    bm.check_invariants()
    assert bm.block_ids("a") == [0, 1] and bm.block_ids("b") == [2, 3]
    assert list(bm.cached.values()) == [0]
    bm.free(b)
    bm.free(a)
    bm.check_invariants()
    # b's block 2 holds a copy nobody can hit: it is reused before the cached block 0.
    assert free_order(bm) == [1, 2, 3, 4, 5, 0]
    assert bm.blocks[2].block_hash is None


def test_failed_allocation_changes_nothing() -> None:
    bm = BlockManager(4, BS)
    a = make_req("a", list(range(8)) + [1])
    assert admit(bm, a) == [0, 1, 2]
    bm.free(a)
    b = make_req("b", list(range(100, 109)))
    assert admit(bm, b) == [2, 3, 1]  # evicts a's tail block 1, keeps block 0 cached
    before = snapshot(bm)

    # A fresh request that needs 2 blocks when 1 is free.
    c = make_req("c", list(range(200, 206)))
    assert not bm.allocate_slots(c, 6)
    assert snapshot(bm) == before
    # A request whose hit block is itself the only free block: taking the hit leaves
    # nothing for its new block.
    d = make_req("d", list(range(4)) + [7, 7])
    hits, n = bm.get_computed_blocks(d)
    assert (hits, n) == ([0], 4)
    before = snapshot(bm)
    assert not bm.allocate_slots(d, 2, hits)
    assert snapshot(bm) == before
    # A running request that cannot grow once the last free block is taken.
    assert admit(bm, make_req("e", [300, 301])) == [0]
    b.append_token(5)
    b.num_computed_tokens = 9
    assert bm.allocate_slots(b, 1)  # 10 tokens still fit in 3 blocks
    for t in range(6, 9):
        b.append_token(t)
    before = snapshot(bm)
    assert not bm.allocate_slots(b, 4)  # 13 tokens need a 4th block
    assert snapshot(bm) == before
    bm.check_invariants()


def test_prefix_caching_off_never_hits_and_frees_to_the_head() -> None:
    bm = BlockManager(6, BS, enable_prefix_caching=False)
    a = make_req("a", list(range(10)))
    assert admit(bm, a) == [0, 1, 2]
    assert bm.cached == {}
    assert all(b.block_hash is None for b in bm.blocks)
    b = make_req("b", list(range(10)))
    assert bm.get_computed_blocks(b) == ([], 0)
    assert admit(bm, b) == [3, 4, 5]
    bm.free(a)
    bm.check_invariants()
    c = make_req("c", list(range(10)))
    assert admit(bm, c) == [0, 1, 2]
    assert bm.hit_rate == 0.0


def test_free_releases_every_reference_and_double_free_is_caught() -> None:
    bm = BlockManager(6, BS)
    prefix = list(range(8))
    a = make_req("a", prefix + [1])
    b = make_req("b", prefix + [2])
    admit(bm, a)
    admit(bm, b)
    assert refs(bm, [0, 1]) == [2, 2]
    bm.free(a)
    bm.check_invariants()
    assert refs(bm, [0, 1]) == [1, 1]
    assert 0 not in bm.free_queue and 1 not in bm.free_queue
    bm.free(b)
    bm.check_invariants()
    assert bm.num_free_blocks == 6
    # Freeing a request that holds nothing is a no-op, not a double free.
    bm.free(b)
    bm.check_invariants()
    assert bm.num_free_blocks == 6
    # Corrupting a count is caught by the invariant check.
    bm.blocks[0].ref_cnt = 1
    with pytest.raises(AssertionError):
        bm.check_invariants()


def test_reset_prefix_cache_drops_only_unreferenced_entries() -> None:
    bm = BlockManager(6, BS)
    a = make_req("a", list(range(8)) + [1])
    b = make_req("b", list(range(100, 108)) + [1])
    admit(bm, a)
    admit(bm, b)
    bm.free(a)
    bm.reset_prefix_cache()
    bm.check_invariants()
    assert sorted(bm.cached.values()) == [3, 4]
    assert bm.get_computed_blocks(make_req("a2", list(range(8)) + [1])) == ([], 0)


def test_bad_num_blocks_is_rejected() -> None:
    with pytest.raises(ValueError, match="num_kv_blocks"):
        BlockManager(0, BS)
