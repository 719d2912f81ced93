"""Paged KV cache bookkeeping with automatic prefix caching (pure Python).

Every KV block has one owner here. A *full* block whose K/V are computed gets a hash
chained from its parent block's hash and its own token ids, so equal prefixes map to
equal hash chains and can share blocks. Blocks are reference counted; a block whose
count drops to zero goes to the tail of the free queue but keeps its hash, so a later
request can still hit it. New allocations pop the head of the free queue (least
recently freed first) and only then drop the popped block's hash: eviction is LRU and
happens only when a block is actually needed.
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
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
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

    def block_ids(self, req_id: str) -> list[int]:
        return self.req_to_blocks.get(req_id, [])

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
        hits: list[int] = []
        for h in request.block_hashes[:max_blocks]:
            block_id = self.cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits, len(hits) * self.block_size

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
        computed_blocks = computed_blocks or []
        held = self.req_to_blocks.get(request.req_id, [])
        assert not (held and computed_blocks), "cache hits only for a request with no blocks"
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        total_blocks = self.blocks_needed(num_computed + num_new_tokens)
        num_new_blocks = total_blocks - len(held) - len(computed_blocks)
        # Hit blocks sitting in the free queue stop being free once we take them.
        num_hits_free = sum(1 for b in computed_blocks if self.blocks[b].ref_cnt == 0)
        if num_new_blocks + num_hits_free > self.num_free_blocks:
            return False
        for b in computed_blocks:
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
        for b in reversed(blocks):
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

    def reset_prefix_cache(self) -> None:
        for h, b in list(self.cached.items()):
            if self.blocks[b].ref_cnt == 0:
                self.blocks[b].block_hash = None
                del self.cached[h]

    # ------------------------------------------------------------- invariants
    def check_invariants(self) -> None:
        refs = [0] * self.num_blocks
        for req_id, blocks in self.req_to_blocks.items():
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
