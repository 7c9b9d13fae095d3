"""The grammar mask in the sampler: the packed bitmask is unpacked on the device, constrained
rows sample only allowed tokens, free rows are untouched, logprobs stay raw, and constrained
rows lose their min_tokens ban."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from engine.sample.grammar_mask import allowed_tokens, unpack_with_numpy, unpack_with_torch
from engine.structured_output.bitmask import GrammarBitmask
from tests.engine.sample.test_sampler import VOCAB, make_sampler, random_logits
from tests.engine.worker.test_model_runner import make_batch, new_request

Unpack = Callable[[torch.Tensor, int], torch.Tensor]


def _bitmask(req_ids: list[str], allowed: list[list[int]], vocab_size: int = VOCAB
             ) -> GrammarBitmask:
    bits = np.zeros((len(req_ids), 32 * ((vocab_size + 31) // 32)), dtype=np.uint8)
    for row, tokens in enumerate(allowed):
        bits[row, tokens] = 1
    words = np.packbits(bits, axis=1, bitorder="little").view(np.int32)
    return GrammarBitmask(req_ids, words)


@pytest.mark.parametrize("unpack", [allowed_tokens, unpack_with_torch, unpack_with_numpy])
@pytest.mark.parametrize("vocab_size", [12, 32, 77])
def test_unpacking_gives_each_tokens_bit(unpack: Unpack, vocab_size: int) -> None:
    rng = np.random.default_rng(vocab_size)
    # Random words, the sign bit set in half of them.
    words = rng.integers(-2**31, 2**31, (5, (vocab_size + 31) // 32)).astype(np.int32)
    expected = [[bool(int(words[row, token // 32]) >> (token % 32) & 1)
                 for token in range(vocab_size)] for row in range(5)]
    unpacked = unpack(torch.from_numpy(words), vocab_size)
    assert unpacked.dtype == torch.bool
    assert unpacked.tolist() == expected


def test_a_bitmask_too_short_for_the_vocabulary_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot cover 33 tokens"):
        allowed_tokens(torch.zeros((1, 1), dtype=torch.int32), 33)


def test_constrained_rows_sample_only_allowed_tokens() -> None:
    batch = make_batch()
    for req_id, temperature in (("a", 0.0), ("b", 1.0), ("c", 1.0)):
        batch.add(new_request(req_id, [1], [], [0], temperature=temperature, min_tokens=2,
                              stop_token_ids=(5,), logprobs=2))
    # Sampling rows c, a, b; a grammar constrains c and a.
    metadata = batch.sampling_metadata([2, 0, 1], _bitmask(["a", "c"], [[5, 11], [2, 9]]))
    assert metadata.grammar is not None
    assert metadata.grammar.rows.tolist() == [1, 0]
    bias = metadata.logit_bias
    assert bias is not None  # b alone keeps its ban of 5 and of EOS (9) until min_tokens
    assert list(zip(bias.rows.tolist(), bias.token_ids.tolist(), strict=True)) == [(2, 5),
                                                                                   (2, 9)]
    sampler = make_sampler()
    for seed in range(20):
        logits = random_logits(3, seed=seed)
        output = sampler(logits, metadata)
        third, first, second = output.sampled_token_ids.tolist()
        assert first in (5, 11) and third in (2, 9) and second not in (5, 9)
        raw = logits.log_softmax(dim=-1)
        assert output.logprobs is not None
        assert torch.allclose(output.logprobs.logprobs[:, 0],
                              raw.gather(1, output.sampled_token_ids.unsqueeze(1))[:, 0])
