import pytest

from engine.kv_cache.block import FreeBlockQueue, KVCacheBlock


def make_queue(n: int) -> tuple[FreeBlockQueue, list[KVCacheBlock]]:
    blocks = [KVCacheBlock(i) for i in range(n)]
    return FreeBlockQueue(blocks), blocks


def ids(queue: FreeBlockQueue) -> list[int]:
    return [block.block_id for block in queue]


def test_popleft_takes_blocks_in_insertion_order() -> None:
    queue, _ = make_queue(4)
    assert [queue.popleft().block_id for _ in range(4)] == [0, 1, 2, 3]
    assert len(queue) == 0
    with pytest.raises(ValueError, match="no free blocks"):
        queue.popleft()


def test_remove_from_middle_head_and_tail_keeps_links() -> None:
    queue, blocks = make_queue(5)
    queue.remove(blocks[2])
    queue.remove(blocks[0])
    queue.remove(blocks[4])
    assert ids(queue) == [1, 3]
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    queue.check_invariants()


def test_removed_block_appends_at_tail() -> None:
    queue, blocks = make_queue(3)
    queue.remove(blocks[0])
    queue.append(blocks[0])
    assert ids(queue) == [1, 2, 0]
    queue.check_invariants()


def test_remove_of_a_block_not_queued_is_an_error() -> None:
    queue, blocks = make_queue(2)
    queue.popleft()
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(blocks[0])
    assert ids(queue) == [1]


def test_popleft_n_is_all_or_nothing() -> None:
    queue, _ = make_queue(3)
    with pytest.raises(ValueError):
        queue.popleft_n(4)
    assert len(queue) == 3
    assert [b.block_id for b in queue.popleft_n(2)] == [0, 1]
    assert ids(queue) == [2]


def test_invariants_catch_a_referenced_free_block() -> None:
    queue, blocks = make_queue(2)
    blocks[1].ref_cnt = 1
    with pytest.raises(AssertionError, match="referenced"):
        queue.check_invariants()
