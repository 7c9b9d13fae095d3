from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.sample.metadata import LogitBias, Penalties, SamplingMetadata
from engine.sample.sampler import (
    Sampler,
    apply_min_p,
    apply_penalties,
    gather_logprobs,
)

VOCAB = 12
NEG_INF = float("-inf")


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def make_metadata(rows: int, **overrides: object) -> SamplingMetadata:
    base = SamplingMetadata(
        temperature=torch.ones(rows), all_greedy=False, top_k=None, top_p=None, max_top_k=None,
        min_p=None,
        seeds=[None] * rows, output_positions=[0] * rows, penalties=None, max_num_logprobs=None,
    )
    return replace(base, **overrides)


def make_sampler(seed: int = 0) -> Sampler:
    return Sampler(torch.Generator().manual_seed(seed))


def kept(logits: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(row != NEG_INF).flatten().tolist()) for row in logits]


def test_min_p_drops_tokens_below_a_fraction_of_the_best() -> None:
    logits = random_logits(2, seed=2)
    min_p = torch.tensor([0.0, 0.3])
    masked = apply_min_p(logits, min_p)
    assert torch.equal(masked[0], logits[0])
    probs = logits[1].softmax(-1)
    assert kept(masked)[1] == set(torch.nonzero(probs >= 0.3 * probs.max()).flatten().tolist())


def test_sampling_follows_the_distribution_and_its_filters() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2] + [1e-9] * (VOCAB - 3)])).repeat(4000, 1)
    tokens = make_sampler()(logits, make_metadata(4000)).sampled_token_ids
    frequencies = torch.bincount(tokens, minlength=VOCAB).float() / 4000
    assert torch.allclose(frequencies[:3], torch.tensor([0.5, 0.3, 0.2]), atol=0.03)
    top2 = make_sampler()(logits, make_metadata(4000, top_k=torch.full((4000,), 2),
                                                max_top_k=2))
    assert set(top2.sampled_token_ids.tolist()) == {0, 1}
    nucleus = make_sampler()(logits, make_metadata(4000, top_p=torch.full((4000,), 0.75)))
    assert set(nucleus.sampled_token_ids.tolist()) == {0, 1}
    cold = make_sampler()(logits, make_metadata(4000, temperature=torch.full((4000,), 0.05)))
    assert (cold.sampled_token_ids == 0).float().mean() > 0.99


def test_greedy_rows_take_the_argmax_beside_random_rows() -> None:
    logits = random_logits(4, seed=3)
    temperature = torch.tensor([0.0, 1.0, 0.0, 1.0])
    sampled = make_sampler()(logits, make_metadata(4, temperature=temperature))
    assert sampled.sampled_token_ids[[0, 2]].tolist() == logits[[0, 2]].argmax(-1).tolist()


def test_seeded_rows_are_reproducible_whatever_the_batch() -> None:
    """A seeded row samples the same tokens alone and beside rows of other seeds and
    filters, which change how its filter's candidates are searched."""
    logits = random_logits(1, seed=4)
    alone = [
        make_sampler(seed=s)(logits, make_metadata(
            1, seeds=[7], output_positions=[p], top_k=torch.tensor([6]),
            top_p=torch.tensor([0.9]), max_top_k=6))
        .sampled_token_ids.item()
        for s, p in enumerate(range(12))
    ] * 2
    batch = torch.cat([random_logits(3, seed=5), logits])
    in_batch = [
        make_sampler(seed=9)(batch, make_metadata(
            4, seeds=[None, 11, None, 7], output_positions=[5, 0, 2, p],
            top_k=torch.tensor([VOCAB, 2, VOCAB, 6]), top_p=torch.tensor([0.5, 1.0, 1.0, 0.9])))
        .sampled_token_ids[3].item()
        for p in list(range(12)) * 2
    ]
    assert alone == in_batch
    assert len(set(alone)) > 1  # positions draw different noise


def test_penalties_match_their_definition() -> None:
    logits = random_logits(2, seed=6)
    output_counts = torch.zeros(2, VOCAB, dtype=torch.int32)
    output_counts[0, [1, 2]] = torch.tensor([3, 1], dtype=torch.int32)
    seen = output_counts > 0
    seen[1, 5] = True  # a prompt token of row 1
    penalties = Penalties(
        presence=torch.tensor([0.5, 0.0]), frequency=torch.tensor([0.25, 0.0]),
        repetition=torch.tensor([1.0, 1.5]), output_counts=output_counts, seen_mask=seen,
    )
    result = apply_penalties(logits, penalties)
    expected = logits.clone()
    expected[0, 1] -= 0.25 * 3 + 0.5
    expected[0, 2] -= 0.25 * 1 + 0.5
    value = logits[1, 5]
    expected[1, 5] = value / 1.5 if value > 0 else value * 1.5
    assert torch.allclose(result, expected)


def test_banned_tokens_are_never_sampled() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 3] = 50.0
    bans = LogitBias(rows=torch.tensor([0, 1, 1]), token_ids=torch.tensor([3, 3, 4]),
                     values=torch.full((3,), float("-inf")))
    metadata = make_metadata(2, temperature=torch.tensor([0.0, 1.0]), logit_bias=bans)
    sampled = make_sampler()(logits, metadata).sampled_token_ids.tolist()
    assert 3 not in sampled and sampled[1] != 4


def test_logprobs_are_those_of_the_raw_distribution() -> None:
    logits = random_logits(3, seed=7)
    metadata = make_metadata(3, temperature=torch.tensor([0.0, 0.7, 1.3]), max_num_logprobs=4,
                             top_k=torch.tensor([VOCAB, 3, VOCAB]))
    output = make_sampler()(logits, metadata)
    assert output.logprobs is not None
    reference = logits.log_softmax(-1)
    sampled = output.sampled_token_ids
    assert torch.equal(output.logprobs.token_ids[:, 0], sampled)
    sampled_reference = reference.gather(1, sampled[:, None])[:, 0]
    assert torch.allclose(output.logprobs.logprobs[:, 0], sampled_reference)
    top_values, top_ids = reference.topk(4)
    assert torch.equal(output.logprobs.token_ids[:, 1:], top_ids)
    assert torch.allclose(output.logprobs.logprobs[:, 1:], top_values)
    expected_ranks = (reference > reference.gather(1, sampled[:, None])).sum(-1) + 1
    assert torch.equal(output.logprobs.sampled_ranks, expected_ranks)
    assert output.logprobs.sampled_ranks[0].item() == 1  # greedy picks the top token


@pytest.mark.parametrize("num_logprobs", [0, 1, 5])
def test_gather_logprobs_shapes(num_logprobs: int) -> None:
    logits = random_logits(2)
    result = gather_logprobs(logits, logits.argmax(-1), num_logprobs)
    assert result.token_ids.shape == (2, 1 + num_logprobs)
    assert result.logprobs.shape == (2, 1 + num_logprobs)
