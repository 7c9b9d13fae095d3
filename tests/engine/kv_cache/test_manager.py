"""KV cache manager: the textbook prefix-caching walk-through with block_size = 4."""

from engine.kv_cache.hashing import hash_block_tokens
from engine.kv_cache.manager import KVCacheManager
from engine.request import Request
from tests.engine.helpers import make_request

A_TO_D, E_TO_H, I_TO_L = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
M_N = [13, 14]


def admit(manager: KVCacheManager, request: Request) -> tuple[list[int], int]:
    """Prefix lookup + allocation for the whole prompt, as the scheduler does on admission."""
    hit = manager.get_computed_blocks(request)
    new_blocks = manager.allocate_slots(request, request.num_tokens - hit.num_tokens, hit)
    assert new_blocks is not None
    request.num_computed_tokens = request.num_tokens
    return [b.block_id for b in hit.blocks], hit.num_tokens


def free_ids(manager: KVCacheManager) -> list[int]:
    return [b.block_id for b in manager.block_pool.free_block_queue]


def cached_id(manager: KVCacheManager, *blocks: list[int]) -> int | None:
    parent = None
    for tokens in blocks:
        parent = hash_block_tokens(parent, tokens)
    block = manager.block_pool.get_cached_block(parent)
    return None if block is None else block.block_id


def test_textbook_prefix_caching_walkthrough() -> None:
    manager = KVCacheManager(num_blocks=6, block_size=4)

    # Request 0: ABCD|EFGH|IJKL|MN -> 4 blocks, the 3 full ones cached.
    r0 = make_request("r0", A_TO_D + E_TO_H + I_TO_L + M_N)
    assert admit(manager, r0) == ([], 0)
    assert manager.get_block_ids("r0") == [0, 1, 2, 3]
    assert cached_id(manager, A_TO_D, E_TO_H, I_TO_L) == 2
    assert free_ids(manager) == [4, 5]

    # Request 1 shares ABCD|EFGH: hits two blocks, allocates two.
    r1 = make_request("r1", A_TO_D + E_TO_H + [20, 21, 22, 23, 24])
    assert admit(manager, r1) == ([0, 1], 8)
    assert manager.get_block_ids("r1") == [0, 1, 4, 5]
    assert [manager.block_pool.blocks[i].ref_cnt for i in (0, 1)] == [2, 2]
    assert free_ids(manager) == []

    # Both finish: blocks are freed tail-first, so suffixes are evicted before prefixes.
    manager.free(r0)
    assert free_ids(manager) == [3, 2]
    manager.free(r1)
    assert free_ids(manager) == [3, 2, 5, 4, 1, 0]
    assert cached_id(manager, A_TO_D, E_TO_H) == 1  # freed, still cached

    # Request 2 hits the cached free blocks (taken out of the queue) and needs two more:
    # the head is uncached block 3, then block 2, the least recently used cached block,
    # which is evicted and removed from the hash map.
    r2 = make_request("r2", A_TO_D + E_TO_H + [30, 31, 32, 33, 34])
    assert admit(manager, r2) == ([0, 1], 8)
    assert manager.get_block_ids("r2") == [0, 1, 3, 2]
    assert cached_id(manager, A_TO_D, E_TO_H, I_TO_L) is None
    assert manager.block_pool.blocks[2].block_hash is None  # now r2's partial tail block
    assert cached_id(manager, A_TO_D, E_TO_H, [30, 31, 32, 33]) == 3
    assert cached_id(manager, A_TO_D, E_TO_H, [20, 21, 22, 23]) == 4  # untouched, still cached
    assert free_ids(manager) == [5, 4]
    manager.check_invariants()


def test_hit_is_capped_at_num_tokens_minus_one() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=4)
    admit(manager, make_request("a", A_TO_D + E_TO_H))
    exact = make_request("b", A_TO_D + E_TO_H)  # identical 8-token prompt
    hit = manager.get_computed_blocks(exact)
    assert hit.num_tokens == 4  # not 8: the last token must be computed
    assert [b.block_id for b in hit.blocks] == [0]
    longer = make_request("c", [*A_TO_D, *E_TO_H, 99])
    assert manager.get_computed_blocks(longer).num_tokens == 8


def test_failed_allocation_changes_nothing() -> None:
    manager = KVCacheManager(num_blocks=3, block_size=4)
    admit(manager, make_request("a", A_TO_D + E_TO_H))
    manager.free(manager_request := make_request("x", [1]))  # unknown request: no-op
    del manager_request
    before = (free_ids(manager), [b.ref_cnt for b in manager.block_pool.blocks])
    big = make_request("big", A_TO_D + E_TO_H + I_TO_L + M_N)
    hit = manager.get_computed_blocks(big)
    assert hit.num_tokens == 8
    assert manager.allocate_slots(big, big.num_tokens - 8, hit) is None
    assert (free_ids(manager), [b.ref_cnt for b in manager.block_pool.blocks]) == before
    assert "big" not in manager.req_to_blocks
    manager.check_invariants()


def test_free_hits_count_against_the_free_pool() -> None:
    # A hit on a free cached block takes it out of the free queue, so it must be counted.
    manager = KVCacheManager(num_blocks=3, block_size=4)
    first = make_request("a", A_TO_D + E_TO_H + [1])
    admit(manager, first)
    manager.free(first)
    second = make_request("b", A_TO_D + E_TO_H + [2, 3, 4, 5, 6, 7, 8, 9])
    hit = manager.get_computed_blocks(second)
    assert hit.num_tokens == 8
    # 2 hit blocks (free) + 2 new blocks > 3 free blocks.
    assert manager.allocate_slots(second, 8, hit) is None
    manager.check_invariants()


def test_decode_registers_blocks_as_they_fill() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=4)
    request = make_request("a", [1, 2, 3])
    admit(manager, request)
    assert manager.num_cached_blocks["a"] == 0
    request.append_output_token_id(4)  # the sampled token, scheduled next step
    assert manager.allocate_slots(request, 1) == []
    assert manager.num_cached_blocks["a"] == 1
    request.num_computed_tokens += 1
    request.append_output_token_id(5)
    new_blocks = manager.allocate_slots(request, 1)
    assert [b.block_id for b in new_blocks] == [1]
    manager.check_invariants()


def test_detach_hands_over_cached_blocks_and_frees_the_tail() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=4)
    request = make_request("a", A_TO_D + E_TO_H + [9])
    admit(manager, request)
    held = manager.detach_cached_blocks(request)
    assert [b.block_id for b in held] == [0, 1]
    assert [b.ref_cnt for b in held] == [1, 1]
    assert free_ids(manager) == [3, 2]
    assert "a" not in manager.req_to_blocks


def test_prefix_caching_off_never_hits() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=4, enable_caching=False)
    admit(manager, first := make_request("a", A_TO_D + E_TO_H))
    manager.free(first)
    assert manager.get_computed_blocks(make_request("b", A_TO_D + E_TO_H + [1])).num_tokens == 0
    manager.check_invariants()
