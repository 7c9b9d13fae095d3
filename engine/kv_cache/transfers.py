"""KV block copies between the device pool and the host tier: which the scheduler queues, and
the per-step list the executor carries out.

A cached device block that becomes evictable (its last holder let go) is *stored*: copied to
a host block. A waiting request whose prefix continues in the host tier has those blocks
*loaded* into newly allocated device blocks. Both are queued here while a step is planned
and handed to the executor with the step (`KVTransfers`); the host blocks they use stay
referenced until the step completes, so they are neither evicted nor reused meanwhile. The
device blocks need no reference: every copy of a step is ordered before the writes that
could overwrite its source (see `KVTransfers`).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from engine.kv_cache.block import KVCacheBlock
from engine.kv_cache.hashing import BlockHash
from engine.kv_cache.host_tier import HostBlock, HostKVTier


class KVTransfers(msgspec.Struct, kw_only=True, frozen=True):
    """One step's block copies, as (source block id, destination block id) pairs.

    The runner executes them in this order, all before the step returns:
    `urgent_stores` (device -> host; their source block is rewritten in this step, or a
    load of this step reads their destination), then `loads` (host -> device), then the
    forward, which must wait for both; `stores` (device -> host) may overlap the forward,
    since nothing in this step writes their source blocks.
    """

    urgent_stores: list[tuple[int, int]] = []
    loads: list[tuple[int, int]] = []
    stores: list[tuple[int, int]] = []

    @property
    def num_stored_blocks(self) -> int:
        return len(self.urgent_stores) + len(self.stores)

    @property
    def num_loaded_blocks(self) -> int:
        return len(self.loads)

    @property
    def is_empty(self) -> bool:
        return not (self.urgent_stores or self.loads or self.stores)


NO_TRANSFERS = KVTransfers()


@dataclass(slots=True)
class _Store:
    block: KVCacheBlock
    block_hash: BlockHash
    host_block: HostBlock


class KVTransferQueue:
    """The host tier and the copies queued for the next step. Owned by the block pool:
    `store` when a cached block becomes evictable, `load` at an admission with host hits;
    the scheduler takes the step's copies with `take` when it emits a step and calls
    `complete` once the executor ran it."""

    def __init__(self, host_tier: HostKVTier) -> None:
        self.host_tier = host_tier
        self._stores: list[_Store] = []
        self._loads: list[tuple[HostBlock, KVCacheBlock]] = []
        self._in_flight_stores: list[HostBlock] = []
        self._in_flight_loads: list[tuple[HostBlock, KVCacheBlock]] = []

    @property
    def num_pending(self) -> int:
        """Copies queued for the next step."""
        return len(self._stores) + len(self._loads)

    def store(self, block: KVCacheBlock) -> None:
        """Queues a copy of a cached device block to the host tier, unless it is there (then
        the host copy becomes the most recently used)."""
        block_hash = block.block_hash
        assert block_hash is not None, f"{block} holds no cached content to store"
        if block_hash in self.host_tier:
            self.host_tier.touch(block_hash)
            return
        host_block = self.host_tier.reserve(block_hash)
        if host_block is not None:
            self._stores.append(_Store(block, block_hash, host_block))

    def lookup(self, block_hash: BlockHash) -> HostBlock | None:
        return self.host_tier.lookup(block_hash)

    def load(self, host_blocks: list[HostBlock], blocks: list[KVCacheBlock]) -> None:
        """Queues copies of `host_blocks` into the newly allocated device `blocks`."""
        assert len(host_blocks) == len(blocks), "one device block per host block"
        self.host_tier.acquire(host_blocks)
        self._loads.extend(zip(host_blocks, blocks, strict=True))

    def take(self) -> KVTransfers:
        """The queued copies as the next step's transfers; their host blocks stay in flight
        until `complete`."""
        assert not (self._in_flight_stores or self._in_flight_loads), (
            "the previous step's copies were not completed")
        if not self._stores and not self._loads:
            return NO_TRANSFERS
        loaded_host_ids = {host_block.host_block_id for host_block, _ in self._loads}
        urgent, lazy = [], []
        for store in self._stores:
            pair = (store.block.block_id, store.host_block.host_block_id)
            rewritten = store.block.block_hash != store.block_hash
            is_urgent = rewritten or store.host_block.host_block_id in loaded_host_ids
            (urgent if is_urgent else lazy).append(pair)
        transfers = KVTransfers(
            urgent_stores=urgent,
            loads=[(host.host_block_id, block.block_id) for host, block in self._loads],
            stores=lazy,
        )
        self._in_flight_stores = [store.host_block for store in self._stores]
        self._in_flight_loads = self._loads
        self._stores, self._loads = [], []
        return transfers

    def complete(self) -> None:
        """The executor ran the taken copies: their host blocks become evictable again, in
        the order that keeps prefixes longest: stores were queued tail first (blocks are
        freed so), loads in prefix order, so loads are released reversed."""
        self.host_tier.release(self._in_flight_stores)
        self.host_tier.release([host for host, _ in reversed(self._in_flight_loads)])
        self._in_flight_stores, self._in_flight_loads = [], []

    def reset(self) -> bool:
        """Empties the host tier, dropping the stores queued for the next step (their
        content is being forgotten anyway); False (no change) while a step's copies are in
        flight."""
        if self._loads or self._in_flight_stores or self._in_flight_loads:
            return False
        self.host_tier.release([store.host_block for store in self._stores])
        self._stores = []
        return self.host_tier.reset()

    def check_invariants(self) -> None:
        """Host blocks are referenced exactly by the queued and in-flight copies, and a
        block being loaded is registered under its host block's hash (it cannot have been
        evicted or reused: that takes an allocation, which happens only while planning)."""
        self.host_tier.check_invariants()
        loads = self._loads + self._in_flight_loads
        for host_block, block in loads:
            assert block.block_hash == host_block.block_hash, (
                f"{block} being loaded from {host_block} holds other content")
        expected: dict[int, int] = {}
        users = ([store.host_block for store in self._stores]
                 + [host_block for host_block, _ in loads] + self._in_flight_stores)
        for host_block in users:
            expected[host_block.host_block_id] = expected.get(host_block.host_block_id, 0) + 1
        for host_block in self.host_tier.blocks:
            assert host_block.ref_cnt == expected.get(host_block.host_block_id, 0), (
                f"{host_block} has ref_cnt {host_block.ref_cnt}, copies "
                f"{expected.get(host_block.host_block_id, 0)}")
        for store in self._stores:
            assert self.host_tier.lookup(store.block_hash) is store.host_block, (
                "a queued store's host block lost its hash")
