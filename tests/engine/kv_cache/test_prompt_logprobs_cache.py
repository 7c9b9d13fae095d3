"""A request with prompt logprobs computes its whole prompt: the prefix cache gives it no hit
until it has sampled a token, and the blocks it computes are cached for others."""

from engine.kv_cache.manager import KVCacheManager
from tests.engine.helpers import make_request
from tests.engine.kv_cache.test_manager import A_TO_D, E_TO_H, admit


def test_prompt_logprobs_skip_the_hit_but_cache_their_blocks() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=4)
    admit(manager, warm := make_request("warm", A_TO_D + E_TO_H))
    manager.free(warm)
    scoring = make_request("scoring", A_TO_D + E_TO_H + [1], prompt_logprobs=0)
    assert scoring.skips_prefix_cache
    assert admit(manager, scoring) == ([], 0)
    assert manager.get_computed_blocks(make_request("plain", A_TO_D + E_TO_H + [1])).num_tokens == 8
    scoring.append_output_token_id(5)  # its prompt logprobs were all returned with this token
    assert not scoring.skips_prefix_cache
    manager.free(scoring)
    assert manager.get_computed_blocks(scoring).num_tokens == 8
    manager.check_invariants()
