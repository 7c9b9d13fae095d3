"""The grammar mask in the sampler: constrained rows sample only allowed tokens, free rows are
untouched, logprobs stay raw, and constrained rows lose their min_tokens ban."""

from __future__ import annotations

import numpy as np
import torch

from engine.sample.grammar_mask import with_grammar_mask
from engine.structured_output.bitmask import GrammarBitmask
from tests.engine.sample.test_sampler import VOCAB, make_metadata, make_sampler, random_logits


def _bitmask(req_ids: list[str], allowed: list[list[int]]) -> GrammarBitmask:
    bits = np.zeros((len(req_ids), 32 * ((VOCAB + 31) // 32)), dtype=np.uint8)
    for row, tokens in enumerate(allowed):
        bits[row, tokens] = 1
    words = np.packbits(bits, axis=1, bitorder="little").view(np.int32)
    return GrammarBitmask(req_ids, words)


def test_constrained_rows_sample_only_allowed_tokens() -> None:
    metadata = make_metadata(3, temperature=torch.tensor([0.0, 1.0, 1.0]),
                             banned_token_ids=[[5], [5], [5]], max_num_logprobs=2)
    allowed = [[2, 9], [5, 11]]
    masked = with_grammar_mask(metadata, ["a", "b", "c"], _bitmask(["c", "a"], allowed), VOCAB)
    assert masked.banned_token_ids == [[], [5], []]
    sampler = make_sampler()
    for seed in range(20):
        logits = random_logits(3, seed=seed)
        output = sampler(logits, masked)
        first, second, third = output.sampled_token_ids.tolist()
        assert first in (5, 11) and third in (2, 9) and second != 5
        raw = logits.log_softmax(dim=-1)
        assert torch.allclose(output.logprobs.logprobs[:, 0],
                              raw.gather(1, output.sampled_token_ids.unsqueeze(1))[:, 0])
