from engine.kv_cache.hashing import extend_block_hashes, hash_block_tokens
from tests.engine.helpers import make_request


def test_hash_is_deterministic_and_content_sensitive() -> None:
    assert hash_block_tokens(None, [1, 2, 3, 4]) == hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(None, [1, 2, 3, 4]) != hash_block_tokens(None, [1, 2, 3, 5])
    assert len(hash_block_tokens(None, [1])) == 32


def test_hash_chains_on_the_parent() -> None:
    parent_a = hash_block_tokens(None, [1, 2])
    parent_b = hash_block_tokens(None, [3, 4])
    assert hash_block_tokens(parent_a, [5, 6]) != hash_block_tokens(parent_b, [5, 6])


def test_encoding_is_unambiguous() -> None:
    # Fixed-width token encoding and a length prefix: no two token lists share bytes.
    assert hash_block_tokens(None, [1, 23]) != hash_block_tokens(None, [12, 3])
    assert hash_block_tokens(None, [0]) != hash_block_tokens(None, [0, 0])
    assert hash_block_tokens(None, [2**40]) != hash_block_tokens(None, [0, 256])


def test_extra_keys_change_the_hash() -> None:
    plain = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(None, [1, 2], ("salt",)) != plain
    assert hash_block_tokens(None, [1, 2], ("a",)) != hash_block_tokens(None, [1, 2], ("b",))


def test_extend_block_hashes_is_incremental_and_covers_full_blocks_only() -> None:
    request = make_request("r", list(range(10)))
    hashes = extend_block_hashes(request, block_size=4)
    assert len(hashes) == 2
    first_two = list(hashes)
    for token in (10, 11):
        request.append_output_token_id(token)
    extend_block_hashes(request, block_size=4)
    assert request.block_hashes[:2] == first_two
    assert len(request.block_hashes) == 3
    fresh = make_request("s", list(range(12)))
    assert extend_block_hashes(fresh, block_size=4) == request.block_hashes


def test_cache_salt_separates_otherwise_equal_prompts() -> None:
    salted = make_request("a", list(range(8)))
    salted.cache_salt = "tenant-1"
    plain = make_request("b", list(range(8)))
    salted_hashes = extend_block_hashes(salted, 4)
    plain_hashes = extend_block_hashes(plain, 4)
    assert salted_hashes[0] != plain_hashes[0]
    assert salted_hashes[1] != plain_hashes[1]
