"""`logit_bias`: additive per-row biases applied by the sampler before penalties and
temperature; logprobs stay those of the unbiased distribution."""

from __future__ import annotations

import torch

from engine.sample.metadata import LogitBias, Penalties
from engine.sample.sampler import apply_logit_bias
from engine.sampling_params import SamplingParams
from tests.engine.sample.test_sampler import VOCAB, make_metadata, make_sampler, random_logits
from tests.engine.worker.test_model_runner import make_batch, new_request


def bias(entries: list[tuple[int, int, float]]) -> LogitBias:
    rows, token_ids, values = zip(*entries, strict=True)
    return LogitBias(rows=torch.tensor(rows), token_ids=torch.tensor(token_ids),
                     values=torch.tensor(values))


def test_bias_is_added_to_its_rows_only_and_leaves_the_input_alone() -> None:
    logits = random_logits(3, seed=1)
    before = logits.clone()
    biased = apply_logit_bias(logits, bias([(0, 2, 5.0), (0, 7, -3.0), (2, 2, 1.5)]))
    expected = before.clone()
    expected[0, 2] += 5.0
    expected[0, 7] -= 3.0
    expected[2, 2] += 1.5
    assert torch.equal(biased, expected)
    assert torch.equal(logits, before)


def test_large_biases_force_and_ban_tokens_for_greedy_and_random_rows() -> None:
    logits = random_logits(4, seed=2)
    best = logits.argmax(-1).tolist()
    metadata = make_metadata(
        4, temperature=torch.tensor([0.0, 0.0, 1.0, 1.0]),
        logit_bias=bias([(0, 5, 100.0), (1, best[1], -100.0), (2, 9, 100.0)]),
    )
    sampler = make_sampler()
    for _ in range(20):
        sampled = sampler(logits, metadata).sampled_token_ids.tolist()
        assert sampled[0] == 5 and sampled[1] != best[1] and sampled[2] == 9
    assert sampler(logits, make_metadata(4, temperature=torch.zeros(4))
                   ).sampled_token_ids.tolist() == best


def test_bias_comes_before_penalties_and_logprobs_stay_raw() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 3] = 4.0
    # Tokens 1 (logit 0, bias +3) and 3 (logit 4) were both seen, and a repetition penalty of
    # 2 halves positive logits. Bias first: 3 -> 1.5 < 2, token 3 wins; a bias added after the
    # penalty would make token 1 win with 3 > 2.
    seen = torch.zeros(1, VOCAB, dtype=torch.bool)
    seen[0, [1, 3]] = True
    penalties = Penalties(presence=torch.zeros(1), frequency=torch.zeros(1),
                          repetition=torch.tensor([2.0]),
                          output_counts=torch.zeros(1, VOCAB, dtype=torch.int32), seen_mask=seen)
    metadata = make_metadata(1, temperature=torch.zeros(1), penalties=penalties,
                             logit_bias=bias([(0, 1, 3.0)]), max_num_logprobs=2)
    output = make_sampler()(logits, metadata)
    assert output.sampled_token_ids.tolist() == [3]
    assert output.logprobs is not None
    reference = logits.log_softmax(-1)
    assert torch.allclose(output.logprobs.logprobs[0, 0], reference[0, 3])
    assert output.logprobs.token_ids[0, 1].item() == 3


def test_input_batch_builds_sparse_entries_only_for_rows_with_a_bias() -> None:
    batch = make_batch()
    batch.add(new_request("a", [1, 2], [], [0]))
    batch.add(new_request("b", [3], [], [1], logit_bias=((4, 2.5), (30, -100.0))))
    batch.add(new_request("c", [5], [], [2], logit_bias=((4, 1.0),)))
    assert batch.sampling_metadata([0]).logit_bias is None
    metadata = batch.sampling_metadata([2, 0, 1])
    assert metadata.logit_bias is not None
    entries = list(zip(metadata.logit_bias.rows.tolist(), metadata.logit_bias.token_ids.tolist(),
                       metadata.logit_bias.values.tolist(), strict=True))
    assert entries == [(0, 4, 1.0), (2, 4, 2.5), (2, 30, -100.0)]


def test_sampling_params_hold_the_bias_as_pairs() -> None:
    params = SamplingParams(logit_bias=((3, 100), (4, -0.5)))
    assert dict(params.logit_bias) == {3: 100, 4: -0.5}
