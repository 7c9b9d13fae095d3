"""The host tier's bookkeeping: LRU eviction, copies in flight, and the hash index."""

import pytest

from engine.kv_cache.block import KVCacheBlock
from engine.kv_cache.host_tier import HostKVTier
from engine.kv_cache.transfers import KVTransferQueue


def _hash(index: int) -> bytes:
    return index.to_bytes(32, "little")


def test_stores_fill_free_blocks_then_evict_the_least_recently_used():
    tier = HostKVTier(2)
    first, second = tier.reserve(_hash(1)), tier.reserve(_hash(2))
    tier.release([first, second])
    tier.acquire([first])  # a load makes the first block the most recently used
    tier.release([first])
    third = tier.reserve(_hash(3))
    assert third is second and _hash(2) not in tier and _hash(1) in tier
    assert tier.stats.num_evicted_blocks == 1
    tier.release([third])
    tier.check_invariants()


def test_blocks_in_flight_are_never_evicted_and_a_store_is_skipped_instead():
    tier = HostKVTier(1)
    block = tier.reserve(_hash(1))
    assert tier.reserve(_hash(2)) is None  # the only block is being written
    assert tier.stats.num_stores_skipped == 1
    tier.release([block])
    tier.acquire([block])  # now being read by a load
    assert tier.reserve(_hash(2)) is None
    tier.release([block])
    assert tier.reserve(_hash(2)) is block
    tier.check_invariants()


def test_reset_and_double_store_and_bad_size():
    tier = HostKVTier(2)
    block = tier.reserve(_hash(1))
    with pytest.raises(ValueError, match="already holds"):
        tier.reserve(_hash(1))
    assert not tier.reset()  # a copy is in flight
    tier.release([block])
    assert tier.reset() and tier.num_used_blocks == 0
    tier.check_invariants()
    with pytest.raises(ValueError, match="at least one block"):
        HostKVTier(0)


def _cached_block(block_id: int, index: int) -> KVCacheBlock:
    block = KVCacheBlock(block_id)
    block.block_hash = _hash(index)
    return block


def test_a_store_is_urgent_when_its_source_is_rewritten_or_a_load_reads_it():
    queue = KVTransferQueue(HostKVTier(8))
    kept, rewritten, reloaded = (_cached_block(i, i) for i in range(3))
    for block in (kept, rewritten, reloaded):
        queue.store(block)
    queue.store(kept)  # already queued: not stored twice
    rewritten.block_hash = None  # evicted and reallocated while the store waits
    destination = _cached_block(7, 2)  # registered at once, as allocate_slots does
    queue.load([queue.lookup(_hash(2))], [destination])
    transfers = queue.take()
    assert transfers.urgent_stores == [(1, 1), (2, 2)]
    assert transfers.loads == [(2, 7)]
    assert transfers.stores == [(0, 0)]
    assert transfers.num_stored_blocks == 3 and transfers.num_loaded_blocks == 1
    queue.check_invariants()
    with pytest.raises(AssertionError, match="not completed"):
        queue.take()
    queue.complete()
    queue.check_invariants()
    assert queue.take().is_empty
    assert all(block.ref_cnt == 0 for block in queue.host_tier.blocks)


def test_a_reloaded_chain_is_evicted_tail_first_so_its_prefix_stays_a_hit():
    queue = KVTransferQueue(HostKVTier(3))
    chain = [_cached_block(block_id, index) for block_id, index in ((0, 10), (1, 11), (2, 12))]
    for block in reversed(chain):  # blocks are freed tail first
        queue.store(block)
    queue.take()
    queue.complete()
    host_blocks = [queue.lookup(block.block_hash) for block in chain]
    destinations = [_cached_block(block_id, index) for block_id, index in ((5, 10), (6, 11),
                                                                           (7, 12))]
    queue.load(host_blocks, destinations)
    queue.take()
    queue.complete()
    queue.store(_cached_block(8, 20))  # a new store evicts one block of the chain
    assert _hash(10) in queue.host_tier and _hash(11) in queue.host_tier
    assert _hash(12) not in queue.host_tier
    queue.store(chain[0])  # storing content already there makes it the most recently used
    queue.store(_cached_block(9, 21))
    assert _hash(10) in queue.host_tier and _hash(11) not in queue.host_tier
    queue.check_invariants()
