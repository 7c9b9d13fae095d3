"""Per-request view of the KV cache: prefix lookup, slot allocation and freeing."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.kv_cache.block import KVCacheBlock
from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.hashing import extend_block_hashes
from engine.request import Request


@dataclass
class PrefixCacheStats:
    """Counters of prefix lookups at admission, in tokens (cumulative since start)."""

    num_requests: int = 0
    num_query_tokens: int = 0
    num_hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0


class KVCacheManager:
    """Owns the blocks of RUNNING requests (`req_to_blocks`) on top of a `BlockPool`.

    Called by the scheduler only: `get_computed_blocks` when a request is admitted,
    `allocate_slots` whenever a request is scheduled, `free` / `detach_cached_blocks` when it
    stops running. Waiting requests own no blocks.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.stats = PrefixCacheStats()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of `request` as (blocks, tokens). Changes no state.

        The hit is capped at `num_tokens - 1` so that at least one token is computed (its logits
        are needed to sample the next token). A request that `skips_prefix_cache` gets no hit.
        """
        if not self.enable_caching or request.skips_prefix_cache:
            return [], 0
        block_hashes = extend_block_hashes(request, self.block_size)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_new_computed_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Gives `request` slots for `num_new_tokens` more tokens; returns the new blocks.

        `new_computed_blocks` are prefix hits from `get_computed_blocks`, taken (referenced)
        here. Returns None, changing nothing, when the free queue cannot supply the blocks.
        Newly full blocks are registered in the prefix cache at once: their KV is computed
        by the step being scheduled.
        """
        blocks = self.req_to_blocks.get(request.request_id)
        num_tokens_after = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_required_blocks = -(-num_tokens_after // self.block_size)
        num_held_blocks = (0 if blocks is None else len(blocks)) + len(new_computed_blocks)
        num_to_allocate = max(num_required_blocks - num_held_blocks, 0)
        # Hits on free cached blocks take them out of the free queue too.
        num_free_needed = num_to_allocate + sum(b.ref_cnt == 0 for b in new_computed_blocks)
        if num_free_needed > self.block_pool.num_free_blocks:
            return None

        if blocks is None:
            blocks = self._admit(request, new_computed_blocks, num_new_computed_tokens)
        new_blocks = self.block_pool.allocate(num_to_allocate) if num_to_allocate else []
        blocks.extend(new_blocks)
        if self.enable_caching:
            num_full_blocks = min(num_tokens_after, request.num_tokens) // self.block_size
            if num_full_blocks > self.num_cached_blocks[request.request_id]:
                self._cache_full_blocks(request, blocks, num_full_blocks)
        return new_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def free(self, request: Request) -> None:
        """Drops every block reference of `request`, tail first (prefixes outlive suffixes)."""
        blocks, _ = self._release_ownership(request)
        self.block_pool.free_blocks(reversed(blocks))

    def detach_cached_blocks(self, request: Request) -> list[KVCacheBlock]:
        """Stops tracking `request`; hands its prefix-cached blocks, still referenced, to the
        caller (a pin) and frees the rest (the partial tail, whose KV no lookup can find)."""
        blocks, num_cached = self._release_ownership(request)
        self.block_pool.free_blocks(reversed(blocks[num_cached:]))
        return blocks[:num_cached]

    def _release_ownership(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Forgets `request`'s blocks (references unchanged) and un-caches those registered
        for KV that was never computed: blocks cached when scheduled in a step that was then
        undone because the request was preempted later in the same `schedule()`.
        Returns the blocks and how many of them (a prefix) stay cached."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        num_cached = self.num_cached_blocks.pop(request.request_id, 0)
        num_computed_blocks = request.num_computed_tokens // self.block_size
        for block in blocks[num_computed_blocks:num_cached]:
            self.block_pool.uncache(block)
        return blocks, min(num_cached, num_computed_blocks)

    def _admit(
        self,
        request: Request,
        computed_blocks: Sequence[KVCacheBlock],
        num_computed_tokens: int,
    ) -> list[KVCacheBlock]:
        self.block_pool.touch(computed_blocks)
        blocks = list(computed_blocks)
        self.req_to_blocks[request.request_id] = blocks
        self.num_cached_blocks[request.request_id] = len(computed_blocks)
        self.stats.num_requests += 1
        self.stats.num_query_tokens += request.num_tokens
        self.stats.num_hit_tokens += num_computed_tokens
        return blocks

    def _cache_full_blocks(
        self, request: Request, blocks: list[KVCacheBlock], num_full_blocks: int
    ) -> None:
        num_cached = self.num_cached_blocks[request.request_id]
        block_hashes = extend_block_hashes(request, self.block_size)
        self.block_pool.cache_full_blocks(blocks, block_hashes, num_cached, num_full_blocks)
        self.num_cached_blocks[request.request_id] = num_full_blocks

    def check_invariants(self) -> None:
        """Per-request block lists are consistent with their prefix-cache registration."""
        self.block_pool.check_invariants()
        assert self.req_to_blocks.keys() == self.num_cached_blocks.keys()
        for request_id, blocks in self.req_to_blocks.items():
            num_cached = self.num_cached_blocks[request_id]
            assert num_cached <= len(blocks), f"{request_id}: more cached blocks than blocks"
            for index, block in enumerate(blocks):
                assert block.ref_cnt > 0, f"{request_id} holds unreferenced {block}"
                is_cached = block.block_hash is not None
                assert is_cached == (index < num_cached), (
                    f"{request_id}: {block} at {index} disagrees with {num_cached} cached blocks"
                )
