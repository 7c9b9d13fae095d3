"""The pool of physical KV blocks: allocation, reference counts and the prefix-cache map."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from engine.kv_cache.block import FreeBlockQueue, KVCacheBlock
from engine.kv_cache.hashing import BlockHash
from engine.kv_cache.transfers import KVTransferQueue


class BlockHashToBlockMap:
    """Prefix-cache index: block hash -> the cached blocks with that content.

    Two blocks can hold the same content when two requests computed the same prefix at once;
    both stay registered so either can serve a hit, and evicting one leaves the other findable.
    """

    def __init__(self) -> None:
        self._map: dict[BlockHash, dict[int, KVCacheBlock]] = {}

    def get_one_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        blocks = self._map.get(block_hash)
        return None if blocks is None else next(iter(blocks.values()))

    def insert(self, block_hash: BlockHash, block: KVCacheBlock) -> None:
        self._map.setdefault(block_hash, {})[block.block_id] = block

    def pop(self, block_hash: BlockHash, block_id: int) -> KVCacheBlock | None:
        blocks = self._map.get(block_hash)
        if blocks is None:
            return None
        block = blocks.pop(block_id, None)
        if not blocks:
            del self._map[block_hash]
        return block

    def __len__(self) -> int:
        return sum(len(blocks) for blocks in self._map.values())

    def items(self) -> Iterable[tuple[BlockHash, KVCacheBlock]]:
        for block_hash, blocks in self._map.items():
            for block in blocks.values():
                yield block_hash, block


class BlockPool:
    """Owns every `KVCacheBlock`, the free queue and the prefix-cache map.

    Holders (the KV cache manager for running requests, the pin table for pins) take references
    with `allocate` or `touch` and give them back with `free_blocks`. A block whose `ref_cnt`
    drops to 0 goes to the free queue tail but keeps its hash: it stays a prefix-cache hit until
    `allocate` evicts it. With a host tier (`transfers`), such a block is also queued to be
    stored there (unless the holder that let go says not to), so that eviction only demotes it.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 transfers: KVTransferQueue | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks = BlockHashToBlockMap()
        self.num_cached_free_blocks = 0  # free blocks that still hold a prefix (evictable)
        self.transfers = transfers

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by a holder (cached free blocks count as unused)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_blocks.get_one_block(block_hash)

    def allocate(self, num_blocks: int) -> list[KVCacheBlock]:
        """Takes `num_blocks` blocks from the free-queue head, evicting their cached content."""
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            if block.block_hash is not None:
                self.uncache(block)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Takes one more reference on each block (a prefix hit); free ones leave the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
                if block.block_hash is not None:
                    self.num_cached_free_blocks -= 1
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock], *, offload: bool = True) -> None:
        """Drops one reference per block, in the given order; unreferenced blocks go to the tail,
        and cached ones are queued for the host tier (if any) when `offload`.

        Callers pass a request's blocks tail-first so that prefixes outlive suffixes.
        """
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"{block} freed more often than referenced"
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)
                if block.block_hash is not None:
                    self.num_cached_free_blocks += 1
                    if offload and self.transfers is not None:
                        self.transfers.store(block)

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        start: int,
        end: int,
    ) -> None:
        """Registers `blocks[start:end]` under `block_hashes[start:end]` in the prefix cache."""
        for index in range(start, end):
            block = blocks[index]
            assert block.block_hash is None, f"{block} is already cached"
            block.block_hash = block_hashes[index]
            self.cached_blocks.insert(block.block_hash, block)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached hash, in the host tier too (stores queued for the next step
        are dropped); only allowed while no block is referenced and no step's copies are in
        flight."""
        if self.num_free_blocks != self.num_blocks:
            return False
        if self.transfers is not None and not self.transfers.reset():
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_blocks = BlockHashToBlockMap()
        self.num_cached_free_blocks = 0
        return True

    def uncache(self, block: KVCacheBlock) -> None:
        """Removes a block from the prefix cache (eviction, or KV that was never computed)."""
        assert block.block_hash is not None, f"{block} is not cached"
        if block.ref_cnt == 0:
            self.num_cached_free_blocks -= 1
        self.cached_blocks.pop(block.block_hash, block.block_id)
        block.block_hash = None

    def check_invariants(self) -> None:
        """Free queue well formed and equal to the unreferenced blocks; hash map consistent."""
        self.free_block_queue.check_invariants()
        free_ids = {block.block_id for block in self.free_block_queue}
        unreferenced = {block.block_id for block in self.blocks if block.ref_cnt == 0}
        assert free_ids == unreferenced, "free queue differs from the unreferenced blocks"
        registered = set()
        for block_hash, block in self.cached_blocks.items():
            assert block.block_hash == block_hash, f"{block} indexed under another hash"
            registered.add(block.block_id)
        hashed = {block.block_id for block in self.blocks if block.block_hash is not None}
        assert registered == hashed, "hashed blocks differ from the prefix-cache index"
        cached_free = sum(1 for block in self.free_block_queue if block.block_hash is not None)
        assert cached_free == self.num_cached_free_blocks, "cached free block count drifted"
        if not self.enable_caching:
            assert not hashed, "prefix caching is off but blocks are cached"
        if self.transfers is not None:
            self.transfers.check_invariants()
