import pytest

from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.hashing import hash_block_tokens


def free_ids(pool: BlockPool) -> list[int]:
    return [block.block_id for block in pool.free_block_queue]


def test_allocate_takes_from_the_head_with_one_reference() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    assert [b.block_id for b in blocks] == [0, 1]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert free_ids(pool) == [2, 3]
    assert pool.usage == 0.5
    pool.check_invariants()


def test_allocate_more_than_free_raises_without_change() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.allocate(3)
    assert free_ids(pool) == [0, 1]


def test_allocation_evicts_cached_content() -> None:
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    block_hash = hash_block_tokens(None, [1, 2])
    pool.cache_full_blocks(blocks, [block_hash], 0, 1)
    pool.free_blocks(blocks)
    assert pool.get_cached_block(block_hash) is blocks[0]  # freed but still cached
    pool.allocate(2)  # reaches the cached block: evicted
    assert pool.get_cached_block(block_hash) is None
    assert blocks[0].block_hash is None
    pool.check_invariants()


def test_touch_takes_free_cached_blocks_out_of_the_queue() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(2)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [2, 1, 0]
    pool.touch([blocks[0]])
    assert free_ids(pool) == [2, 1]
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 2
    pool.check_invariants()


def test_duplicate_content_keeps_both_blocks_findable() -> None:
    pool = BlockPool(4)
    first, second = pool.allocate(2)
    block_hash = hash_block_tokens(None, [7, 7])
    pool.cache_full_blocks([first, second], [block_hash, block_hash], 0, 2)
    pool.free_blocks([first, second])
    pool.allocate(3)  # evicts `first` (and two uncached blocks), keeps `second`
    assert pool.get_cached_block(block_hash) is second
    pool.check_invariants()


def test_reset_prefix_cache_only_when_nothing_is_held() -> None:
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.cache_full_blocks(blocks, [hash_block_tokens(None, [1])], 0, 1)
    assert pool.reset_prefix_cache() is False
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(hash_block_tokens(None, [1])) is None
    pool.check_invariants()


def test_over_free_is_caught() -> None:
    pool = BlockPool(1)
    blocks = pool.allocate(1)
    pool.free_blocks(blocks)
    with pytest.raises(AssertionError):
        pool.free_blocks(blocks)
