"""The host-memory KV tier: blocks in host memory keyed by the same chained block hashes as
the device prefix cache, with their own LRU.

Bookkeeping only (torch-free); the copies are the executor's (`engine.kv_cache.transfers`
says which). A host block is in exactly one of three states: free (no content), cached and
unreferenced (in the LRU, evictable), or referenced by copies in flight (a store writing it,
loads reading it), which neither evicts nor reuses it.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from engine.kv_cache.hashing import BlockHash


class HostBlock:
    """Metadata of one host block. `ref_cnt` counts the copies in flight that use it;
    `block_hash` is its content (None while free)."""

    __slots__ = ("block_hash", "host_block_id", "ref_cnt")

    def __init__(self, host_block_id: int) -> None:
        self.host_block_id = host_block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None

    def __repr__(self) -> str:
        digest = None if self.block_hash is None else self.block_hash[:4].hex()
        return f"HostBlock(id={self.host_block_id}, ref_cnt={self.ref_cnt}, hash={digest})"


@dataclass
class HostTierStats:
    """Cumulative counters of the host tier, in blocks."""

    num_stored_blocks: int = 0
    num_loaded_blocks: int = 0
    num_evicted_blocks: int = 0
    num_stores_skipped: int = 0  # every host block was in flight: the block was not stored


class HostKVTier:
    """Owns the host blocks, their hash index and LRU. Called by the block pool: `reserve`
    when a cached device block becomes evictable (a store), `acquire` when an admission
    loads host hits, `release` when the step that copied them completed."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the host tier needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [HostBlock(host_block_id) for host_block_id in range(num_blocks)]
        self._free: deque[HostBlock] = deque(self.blocks)
        self._by_hash: dict[BlockHash, HostBlock] = {}
        self._lru: OrderedDict[int, HostBlock] = OrderedDict()  # least recently used first
        self.stats = HostTierStats()

    @property
    def num_used_blocks(self) -> int:
        """Blocks holding content (cached or being written)."""
        return len(self._by_hash)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._by_hash

    def lookup(self, block_hash: BlockHash) -> HostBlock | None:
        return self._by_hash.get(block_hash)

    def touch(self, block_hash: BlockHash) -> None:
        """Marks the cached block of `block_hash` most recently used (its content was about
        to be stored again)."""
        host_block = self._by_hash[block_hash]
        if host_block.ref_cnt == 0:
            self._lru.move_to_end(host_block.host_block_id)

    def reserve(self, block_hash: BlockHash) -> HostBlock | None:
        """A host block for storing `block_hash`, referenced until the store completes: a
        free one, else the least recently used (evicted). None when every block is in
        flight (the store is skipped and counted)."""
        if block_hash in self._by_hash:
            raise ValueError("the host tier already holds this block hash")
        if self._free:
            host_block = self._free.popleft()
        elif self._lru:
            _, host_block = self._lru.popitem(last=False)
            assert host_block.block_hash is not None
            del self._by_hash[host_block.block_hash]
            self.stats.num_evicted_blocks += 1
        else:
            self.stats.num_stores_skipped += 1
            return None
        host_block.block_hash = block_hash
        host_block.ref_cnt = 1
        self._by_hash[block_hash] = host_block
        self.stats.num_stored_blocks += 1
        return host_block

    def acquire(self, host_blocks: list[HostBlock]) -> None:
        """References cached host blocks for loads; they leave the LRU until released."""
        for host_block in host_blocks:
            assert host_block.block_hash is not None, f"{host_block} holds nothing to load"
            if host_block.ref_cnt == 0:
                del self._lru[host_block.host_block_id]
            host_block.ref_cnt += 1
        self.stats.num_loaded_blocks += len(host_blocks)

    def release(self, host_blocks: list[HostBlock]) -> None:
        """Drops one reference per block; unreferenced blocks become the most recently used."""
        for host_block in host_blocks:
            host_block.ref_cnt -= 1
            assert host_block.ref_cnt >= 0, f"{host_block} released more often than acquired"
            if host_block.ref_cnt == 0:
                self._lru[host_block.host_block_id] = host_block

    def reset(self) -> bool:
        """Forgets every cached block; False (no change) while a copy is in flight."""
        if any(host_block.ref_cnt for host_block in self.blocks):
            return False
        for host_block in self.blocks:
            host_block.block_hash = None
        self._free = deque(self.blocks)
        self._by_hash.clear()
        self._lru.clear()
        return True

    def check_invariants(self) -> None:
        """Every host block is free, cached in the LRU, or in flight; the index is exact."""
        free_ids = {host_block.host_block_id for host_block in self._free}
        assert len(free_ids) == len(self._free), "a host block is free twice"
        for host_block in self._free:
            assert host_block.block_hash is None and host_block.ref_cnt == 0, (
                f"free {host_block} holds content or references")
        for host_block_id, host_block in self._lru.items():
            assert host_block.host_block_id == host_block_id, "LRU keyed by another id"
            assert host_block.ref_cnt == 0, f"{host_block} in flight but evictable"
        assert not free_ids & self._lru.keys(), "a host block is both free and cached"
        for block_hash, host_block in self._by_hash.items():
            assert host_block.block_hash == block_hash, f"{host_block} indexed under another hash"
        for host_block in self.blocks:
            if host_block.host_block_id in free_ids:
                continue
            assert host_block.block_hash is not None, f"{host_block} is lost"
            assert self._by_hash.get(host_block.block_hash) is host_block, (
                f"{host_block} missing from the hash index")
            in_lru = host_block.host_block_id in self._lru
            assert in_lru == (host_block.ref_cnt == 0), f"{host_block} LRU membership is wrong"
        assert len(free_ids) + len(self._by_hash) == self.num_blocks, "host blocks leaked"
