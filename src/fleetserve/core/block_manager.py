"""Paged KV cache bookkeeping with automatic prefix caching (pure Python).

Every KV block has one owner here. A *full* block whose K/V are computed gets a hash
chained from its parent block's hash and its own token ids, so equal prefixes map to
equal hash chains and can share blocks. Blocks are reference counted; a block whose
count drops to zero goes to the tail of the free queue but keeps its hash, so a later
request can still hit it. New allocations pop the head of the free queue (least
recently freed first) and only then drop the popped block's hash: eviction is LRU and
happens only when a block is actually needed.

With a ``sliding_window`` W (the manager of layers that attend to their last W tokens),
a request's leading blocks that no future query can see are *released* as its
computation advances: a query at position p >= num_computed_tokens sees keys
p - W + 1 .. p, so every block wholly before key num_computed_tokens - W + 1 is dead.

    tokens:  0 .............. num_computed - W + 1 ....... num_computed ...
    blocks:  [ released | released | live | live | live ... ]

Released entries stay in the request's block list as placeholders (their positions
keep the list aligned with token positions; the attention kernels never read them), and
``req_num_released`` counts them; the blocks themselves go back to the free queue with
their hashes, so a prefix-cache hit can still find them while they are not reused.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from fleetserve.core.request import Request

BlockHash = int


def hash_block(parent: BlockHash | None, token_ids: tuple[int, ...]) -> BlockHash:
    return hash((parent, token_ids))


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        sliding_window: int | None = None,
    ):
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.sliding_window = sliding_window
        # Leading entries of a request's block list given back (sliding window only).
        self.req_num_released: dict[str, int] = {}
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Free blocks in eviction order (head is evicted first). dict keeps insertion order.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[BlockHash, int] = {}
        self.req_to_blocks: dict[str, list[int]] = {}
        # How many of a request's leading blocks are registered in the prefix cache.
        self.req_num_hashed: dict[str, int] = {}
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def max_blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks a request of `num_tokens` tokens holds at once when each step
        gives it at most `max_chunk` new slots: all of them, or with a sliding window those
        of W - 1 keys before a chunk, the chunk and two partial blocks."""
        n = self.blocks_needed(num_tokens)
        if self.sliding_window is None:
            return n
        return min(n, self.blocks_needed(self.sliding_window - 1 + max_chunk) + 2)

    def block_ids(self, req_id: str) -> list[int]:
        return self.req_to_blocks.get(req_id, [])

    def window_block_ids(self, req_id: str) -> list[int] | None:
        """The sliding-window layers' own block list, where they have one (see
        core/hybrid_blocks.py); None: every layer uses `block_ids`."""
        return None

    def _num_dead(self, num_computed: int) -> int:
        """Leading blocks no query at a position >= num_computed can see."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed - self.sliding_window + 1) // self.block_size

    def _held(self, req_id: str) -> list[int]:
        """The blocks the request holds references on (past its released ones)."""
        return self.req_to_blocks.get(req_id, [])[self.req_num_released.get(req_id, 0) :]

    def _update_block_hashes(self, request: Request) -> None:
        bs = self.block_size
        tokens = request.all_token_ids
        while (len(request.block_hashes) + 1) * bs <= len(tokens):
            i = len(request.block_hashes)
            parent = request.block_hashes[-1] if i else request.cache_salt
            request.block_hashes.append(hash_block(parent, tuple(tokens[i * bs : (i + 1) * bs])))

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest run of cached blocks that prefixes the request's tokens.

        At least one token is always left to compute, since sampling needs the logits
        of the last position.
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        if self.sliding_window is not None:
            window_hits = self.window_hits(request, max_blocks)
            return window_hits, len(window_hits) * self.block_size
        hits: list[int] = []
        for h in request.block_hashes[:max_blocks]:
            block_id = self.cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits, len(hits) * self.block_size

    def window_hits(self, request: Request, max_blocks: int) -> list[int]:
        """Sliding window: the longest run of n <= max_blocks leading blocks whose live
        part (blocks _num_dead(n * block_size) .. n - 1) is all cached; the dead part
        needs no content, its entries are placeholders (block 0). Call after
        `_update_block_hashes`."""
        best, run_start = 0, 0
        ids: list[int | None] = []
        for j, h in enumerate(request.block_hashes[:max_blocks]):
            block_id = self.cached.get(h)
            ids.append(block_id)
            if block_id is None:
                run_start = j + 1
            elif run_start <= self._num_dead((j + 1) * self.block_size):
                best = j + 1
        dead = self._num_dead(best * self.block_size)
        return [0] * dead + [b for b in ids[dead:best] if b is not None]

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's prefix-cache lookup (for the hit-rate metric)."""
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens

    # ------------------------------------------------------------- allocation
    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[int] | None = None
    ) -> bool:
        """Give the request blocks for ``num_computed_tokens + num_new_tokens`` tokens.

        ``computed_blocks`` are prefix-cache hits for a request that holds no block yet.
        Returns False and changes nothing when the free blocks do not suffice.
        """
        if not computed_blocks and self.sliding_window is None:
            held = self.req_to_blocks.get(request.req_id)
            if held is not None and len(held) * self.block_size >= (
                request.num_computed_tokens + num_new_tokens
            ):
                return True  # a decode inside its last block: nothing to take
        computed_blocks = computed_blocks or []
        self.release_out_of_window(request)
        held = self.req_to_blocks.get(request.req_id, [])
        assert not (held and computed_blocks), "cache hits only for a request with no blocks"
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        total_blocks = self.blocks_needed(num_computed + num_new_tokens)
        num_new_blocks = total_blocks - len(held) - len(computed_blocks)
        # A hit's dead leading entries (sliding window) are placeholders, not taken.
        num_dead_hits = self._num_dead(len(computed_blocks) * self.block_size)
        live_hits = computed_blocks[num_dead_hits:]
        # Hit blocks sitting in the free queue stop being free once we take them.
        num_hits_free = sum(1 for b in live_hits if self.blocks[b].ref_cnt == 0)
        if num_new_blocks + num_hits_free > self.num_free_blocks:
            return False
        if num_dead_hits:
            self.req_num_released[request.req_id] = num_dead_hits
        for b in live_hits:
            block = self.blocks[b]
            if block.ref_cnt == 0:
                del self.free_queue[b]
            block.ref_cnt += 1
        new_ids = [self._pop_free_block() for _ in range(max(num_new_blocks, 0))]
        blocks = self.req_to_blocks.setdefault(request.req_id, [])
        blocks.extend(computed_blocks)
        blocks.extend(new_ids)
        if computed_blocks:
            self.req_num_hashed[request.req_id] = len(computed_blocks)
        return True

    def release_out_of_window(self, request: Request) -> int:
        """Sliding window: give back the request's blocks that slid wholly out of every
        future query's window; returns how many."""
        blocks = self.req_to_blocks.get(request.req_id)
        if self.sliding_window is None or not blocks:
            return 0
        start = self.req_num_released.get(request.req_id, 0)
        dead = min(self._num_dead(request.num_computed_tokens), len(blocks))
        if dead <= start:
            return 0
        for b in blocks[start:dead]:
            self._unref(b)
        self.req_num_released[request.req_id] = dead
        return dead - start

    def _unref(self, b: int) -> None:
        block = self.blocks[b]
        block.ref_cnt -= 1
        assert block.ref_cnt >= 0, f"double free of block {b}"
        if block.ref_cnt == 0:
            if block.block_hash is None or self.cached.get(block.block_hash) != b:
                # Uncached content is worthless: reuse it before any cached block.
                block.block_hash = None
                self.free_queue[b] = None
                self.free_queue.move_to_end(b, last=False)
            else:
                self.free_queue[b] = None

    def _pop_free_block(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            # Evict: only now does the cached content go away.
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            block.block_hash = None
        block.ref_cnt = 1
        return block_id

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's blocks that became full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        blocks = self.req_to_blocks.get(request.req_id)
        if not blocks:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(blocks))
        start = self.req_num_hashed.get(request.req_id, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request)
        # Released entries (sliding window) are not the request's to register.
        start = max(start, self.req_num_released.get(request.req_id, 0))
        for i in range(start, num_full):
            h = request.block_hashes[i]
            block = self.blocks[blocks[i]]
            if block.block_hash is None:
                block.block_hash = h
                # A different block may already hold the same content (computed by two
                # requests at once); keep the first, the second is freed normally.
                self.cached.setdefault(h, block.block_id)
        self.req_num_hashed[request.req_id] = num_full

    def free_tail(self, request: Request, num_tokens: int) -> int:
        """Give back the request's blocks past those that hold its first ``num_tokens``
        tokens; returns how many. They held only rejected draft tokens' K/V (or a draft
        model's lookahead): never registered in the prefix cache, since only blocks full
        of verified, computed tokens are.

            blocks:  [ 0 | 1 | ... | keep - 1 ][ keep ... ]  <- freed
            tokens:  0 ............ num_tokens)
        """
        blocks = self.req_to_blocks.get(request.req_id)
        keep = self.blocks_needed(num_tokens)
        if not blocks or len(blocks) <= keep:
            return 0
        tail = blocks[keep:]
        del blocks[keep:]
        for b in reversed(tail):
            block = self.blocks[b]
            assert block.block_hash is None and block.ref_cnt == 1, f"tail block {b} is shared"
            block.ref_cnt = 0
            # Worthless content: reused before any cached block.
            self.free_queue[b] = None
            self.free_queue.move_to_end(b, last=False)
        return len(tail)

    def free(self, request: Request) -> None:
        """Drop the request's references. Its tail blocks are freed first so that they
        are evicted before the (more shareable) head blocks."""
        blocks = self.req_to_blocks.pop(request.req_id, [])
        self.req_num_hashed.pop(request.req_id, None)
        num_released = self.req_num_released.pop(request.req_id, 0)
        for b in reversed(blocks[num_released:]):
            self._unref(b)

    def reset_prefix_cache(self) -> None:
        for h, b in list(self.cached.items()):
            if self.blocks[b].ref_cnt == 0:
                self.blocks[b].block_hash = None
                del self.cached[h]

    # ------------------------------------------------------------- invariants
    def check_invariants(self) -> None:
        refs = [0] * self.num_blocks
        for req_id in self.req_to_blocks:
            blocks = self._held(req_id)
            assert len(blocks) == len(set(blocks)), f"{req_id} holds a block twice"
            for b in blocks:
                refs[b] += 1
        for block in self.blocks:
            assert block.ref_cnt == refs[block.block_id], (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} != holders {refs[block.block_id]}"
            )
            in_free = block.block_id in self.free_queue
            assert in_free == (block.ref_cnt == 0), f"block {block.block_id} free-queue mismatch"
        for h, b in self.cached.items():
            assert self.blocks[b].block_hash == h, f"cache entry {h} -> {b} stale"
