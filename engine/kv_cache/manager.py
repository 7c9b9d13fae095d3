"""Per-request view of the KV cache: prefix lookup, slot allocation and freeing."""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv_cache.block import KVCacheBlock
from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.hashing import extend_block_hashes
from engine.kv_cache.host_tier import HostBlock, HostKVTier
from engine.kv_cache.transfers import NO_TRANSFERS, KVTransferQueue, KVTransfers
from engine.request import Request


@dataclass
class PrefixCacheStats:
    """Counters of prefix lookups at admission, in tokens (cumulative since start);
    `num_hit_tokens` counts both tiers, `num_host_hit_tokens` those loaded from the host."""

    num_requests: int = 0
    num_query_tokens: int = 0
    num_hit_tokens: int = 0
    num_host_hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """A waiting request's cached prefix: `blocks` on the device, then `host_blocks`
    continuing it in the host tier (to be loaded into new device blocks)."""

    blocks: list[KVCacheBlock]
    host_blocks: list[HostBlock]
    block_size: int

    @property
    def num_device_tokens(self) -> int:
        return len(self.blocks) * self.block_size

    @property
    def num_host_tokens(self) -> int:
        return len(self.host_blocks) * self.block_size

    @property
    def num_tokens(self) -> int:
        return self.num_device_tokens + self.num_host_tokens


class KVCacheManager:
    """Owns the blocks of RUNNING requests (`req_to_blocks`) on top of a `BlockPool`, and
    the host tier when `num_host_blocks` > 0 and caching is on (the tier is keyed by the
    prefix cache's hashes; `CacheConfig` refuses a tier without caching).

    Called by the scheduler only: `get_computed_blocks` when a request is admitted (and
    when a job's turn arrives, for a policy that holds its prefix),
    `allocate_slots` whenever a request is scheduled, `free` / `detach_cached_blocks` when it
    stops running, `take_transfers` when a step is emitted and `complete_transfers` once it
    ran. Waiting requests own no blocks.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 num_host_blocks: int = 0) -> None:
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.transfers = (KVTransferQueue(HostKVTier(num_host_blocks))
                          if num_host_blocks and enable_caching else None)
        self.block_pool = BlockPool(num_blocks, enable_caching, self.transfers)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def host_tier(self) -> HostKVTier | None:
        return None if self.transfers is None else self.transfers.host_tier

    def get_computed_blocks(self, request: Request) -> PrefixHit:
        """Longest cached prefix of `request`: device blocks, then host blocks continuing
        the hash chain where the device hits end. Changes no state.

        The hit is capped at `num_tokens - 1` so that at least one token is computed (its logits
        are needed to sample the next token). A request that `skips_prefix_cache` gets no hit.
        """
        hit = PrefixHit([], [], self.block_size)
        if not self.enable_caching or request.skips_prefix_cache:
            return hit
        block_hashes = extend_block_hashes(request, self.block_size)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        for block_hash in block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hit.blocks.append(block)
        if self.transfers is not None:
            for block_hash in block_hashes[len(hit.blocks):max_hit_blocks]:
                host_block = self.transfers.lookup(block_hash)
                if host_block is None:
                    break
                hit.host_blocks.append(host_block)
        return hit

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        hit: PrefixHit | None = None,
    ) -> list[KVCacheBlock] | None:
        """Gives `request` slots for `num_new_tokens` more tokens; returns the new blocks.

        `hit` (from `get_computed_blocks`, at admission only): its device blocks are taken
        (referenced) here, and its host blocks are queued to be loaded into the first new
        blocks (which are not returned: they hold computed KV). Returns None, changing
        nothing, when the free queue cannot supply the blocks. Newly full blocks are
        registered in the prefix cache at once: their KV is computed (or loaded) by the step
        being scheduled, before its forward.
        """
        num_hit_tokens = 0 if hit is None else hit.num_tokens
        num_tokens_after = request.num_computed_tokens + num_hit_tokens + num_new_tokens
        num_to_allocate, num_free_needed = self._blocks_for(request, num_new_tokens, hit)
        if num_free_needed > self.block_pool.num_free_blocks:
            return None

        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is None:
            blocks = self._admit(request, hit or PrefixHit([], [], self.block_size))
        new_blocks = self.block_pool.allocate(num_to_allocate) if num_to_allocate else []
        blocks.extend(new_blocks)
        if hit is not None and hit.host_blocks:
            assert self.transfers is not None
            num_loaded = len(hit.host_blocks)
            expected = request.block_hashes[len(hit.blocks):len(hit.blocks) + num_loaded]
            assert [host.block_hash for host in hit.host_blocks] == expected, (
                "a host hit was evicted after the lookup")
            self.transfers.load(hit.host_blocks, new_blocks[:num_loaded])
            new_blocks = new_blocks[num_loaded:]
        if self.enable_caching:
            num_full_blocks = min(num_tokens_after, request.num_tokens) // self.block_size
            if num_full_blocks > self.num_cached_blocks[request.request_id]:
                self._cache_full_blocks(request, blocks, num_full_blocks)
        return new_blocks

    def num_free_blocks_needed(self, request: Request, num_new_tokens: int,
                               hit: PrefixHit | None = None) -> int:
        """Free blocks `allocate_slots(request, num_new_tokens, hit)` would take: new blocks,
        plus the free cached blocks of the hit (its hits leave the free queue too)."""
        return self._blocks_for(request, num_new_tokens, hit)[1]

    def _blocks_for(self, request: Request, num_new_tokens: int,
                    hit: PrefixHit | None) -> tuple[int, int]:
        """(blocks to allocate, free blocks taken) for `num_new_tokens` more tokens."""
        hit_blocks = [] if hit is None else hit.blocks
        num_hit_tokens = 0 if hit is None else hit.num_tokens
        blocks = self.req_to_blocks.get(request.request_id)
        num_tokens_after = request.num_computed_tokens + num_hit_tokens + num_new_tokens
        num_required_blocks = -(-num_tokens_after // self.block_size)
        num_held_blocks = (0 if blocks is None else len(blocks)) + len(hit_blocks)
        num_to_allocate = max(num_required_blocks - num_held_blocks, 0)
        return num_to_allocate, num_to_allocate + sum(b.ref_cnt == 0 for b in hit_blocks)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def free(self, request: Request, *, offload: bool = True) -> None:
        """Drops every block reference of `request`, tail first (prefixes outlive suffixes);
        blocks it was the last holder of are stored to the host tier when `offload`."""
        blocks, _ = self._release_ownership(request)
        self.block_pool.free_blocks(reversed(blocks), offload=offload)

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

    def take_transfers(self) -> KVTransfers:
        """The host-tier copies queued since the last step, for the step being emitted."""
        return NO_TRANSFERS if self.transfers is None else self.transfers.take()

    def complete_transfers(self) -> None:
        """The step that carried the last taken copies has run."""
        if self.transfers is not None:
            self.transfers.complete()

    def _admit(self, request: Request, hit: PrefixHit) -> list[KVCacheBlock]:
        self.block_pool.touch(hit.blocks)
        blocks = list(hit.blocks)
        self.req_to_blocks[request.request_id] = blocks
        self.num_cached_blocks[request.request_id] = len(hit.blocks)
        self.stats.num_requests += 1
        self.stats.num_query_tokens += request.num_tokens
        self.stats.num_hit_tokens += hit.num_tokens
        self.stats.num_host_hit_tokens += hit.num_host_tokens
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
