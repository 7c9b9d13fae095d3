"""The radix select of `radix_cut` (under Triton's interpreter): each cut is exactly the sort
path's, over the order of every kind of float32, rows longer than one sum of chunks, either
digit width, and targets a thousandth of a token's mass from a crossing; a pass whose sums
fall short of its target keeps its lowest digit; bad input is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

import triton
import triton.language as tl

from engine.sample import radix_cut, top_k_top_p
from engine.sample.radix_cut import radix_cuts
from engine.sample.top_k_top_p import search_on


def sorted_cuts(logits: torch.Tensor, top_k: torch.Tensor | None,
                top_p: torch.Tensor | None) -> torch.Tensor:
    return top_k_top_p._kept_threshold(logits, top_k, top_p, None, "sort").squeeze(1)


def test_top_k_cuts_follow_the_order_of_every_kind_of_float() -> None:
    """Every k of a row holding both infinities (minus infinity twice), the extremes, both
    zeros, subnormals and values of both signs: the k-th largest value, whatever its bits;
    minus infinity at k 12, the last k that is not the whole row."""
    top = torch.finfo(torch.float32).max
    values = torch.tensor([float("-inf"), float("-inf"), -top, -1.0, -1.0e-40, -0.0, 0.0,
                           1.0e-45, 1.0e-40, 0.5, 1.0, top, float("inf")])
    row = values[torch.randperm(len(values), generator=torch.Generator().manual_seed(0))]
    ks = torch.arange(1, len(values))
    cuts = radix_cuts(row.repeat(len(ks), 1), ks, None)
    descending = values.flip(0)
    for k, cut in zip(ks.tolist(), cuts.tolist(), strict=True):
        assert cut == descending[k - 1].item()  # both zeros compare equal (k 7 and 8)
    assert cuts[-1] == float("-inf")


def test_the_cuts_are_the_sort_paths_over_rows_of_several_sums() -> None:
    """Rows of 5,000 tokens (two sums of 8 chunks of 512, the second partial), from peaked to
    flat, one spread over 60 nats, one in bfloat16 (ties) and one with a third of its tokens
    banned: a top-p alone, and with a top-k, cuts where the sort path does, bit for bit."""
    generator = torch.Generator().manual_seed(1)
    vocab = 5000
    logits = torch.randn(5, vocab, generator=generator) * torch.tensor([[6.0], [1.0], [0.02],
                                                                        [1.0], [2.0]])
    logits[1] = torch.linspace(0.0, -60.0, vocab)[torch.randperm(vocab, generator=generator)]
    logits[3] = logits[3].bfloat16().float()
    logits[4, ::3] = float("-inf")
    assert vocab > radix_cut.BLOCK * radix_cut.CHUNKS_PER_SUM  # more than one sum a row
    top_k = torch.tensor([40, 3000, 100, vocab, 1])
    top_p = torch.tensor([0.9, 0.999, 0.5, 0.95, 0.3])
    for k, p in ((None, top_p), (top_k, top_p)):
        assert torch.equal(radix_cuts(logits, k, p), sorted_cuts(logits, k, p)), (k, p)


def test_a_target_a_thousandth_of_a_token_from_its_crossing_is_cut_there() -> None:
    """16,384 tokens 2**-20 apart in logit (nearly equal masses), shuffled. Two values of p
    put the target a few ten-thousandths of a token's mass past the cumulative mass of the
    first 8,160 tokens and short of the first 8,161's (float64 sums of float32 masses, as the
    sort path adds them): a sum that drifted by a thousandth of a token would move the
    cut."""
    num_tokens = 16384
    logits = -torch.arange(num_tokens, dtype=torch.float32) * 2.0**-20
    cumulative = np.cumsum(logits.exp().double().numpy())
    top_p = torch.tensor([0.5, 0.500061])  # targets of total * p in float64
    targets = top_p.double().numpy() * cumulative[-1]
    below, above = targets - cumulative[8159], cumulative[8160] - targets
    assert (below > 0).all() and (above > 0).all() and (np.minimum(below, above) < 1e-3).all()
    shuffled = logits[torch.randperm(num_tokens, generator=torch.Generator().manual_seed(3))]
    rows = shuffled.repeat(2, 1)
    cuts = radix_cuts(rows, None, top_p)
    assert torch.equal(cuts, torch.full((2,), logits[8160].item()))
    assert torch.equal(cuts, sorted_cuts(rows, None, top_p))


def test_either_digit_width_cuts_where_the_sort_path_does() -> None:
    logits = torch.randn(3, 700, generator=torch.Generator().manual_seed(4)) * torch.tensor(
        [[4.0], [1.0], [0.1]])
    top_k, top_p = torch.tensor([20, 700, 3]), torch.tensor([0.9, 0.5, 1.0])
    assert torch.equal(radix_cuts(logits, top_k, top_p, digit_bits=2),
                       sorted_cuts(logits, top_k, top_p))


@triton.jit
def _choose_digit_kernel(weights_ptr, above_ptr, target_ptr, digit_ptr, new_above_ptr):
    weights = tl.load(weights_ptr + tl.arange(0, 16))
    digit, above = radix_cut._choose_digit(weights, tl.load(above_ptr), tl.load(target_ptr), 4)
    tl.store(digit_ptr, digit)
    tl.store(new_above_ptr, above)


@pytest.mark.parametrize(("target", "digit", "new_above"), [
    (2.5, 14, 2.0),  # the weight from the top reaches 2.5 at digit 14: 1 above + 1 + 0.5
    (1.0, 15, 1.0),  # reached by the top digit's own weight
    (9.0, 0, 2.5),  # never reached (a rounding): digit 0, all the weights above it kept
])
def test_a_pass_takes_the_highest_digit_that_reaches_its_target(
        target: float, digit: int, new_above: float) -> None:
    weights = torch.zeros(16, dtype=torch.float64)
    weights[15], weights[14] = 1.0, 0.5
    weights[0] = 2.0
    above = torch.tensor([1.0], dtype=torch.float64)
    found_digit = torch.zeros(1, dtype=torch.int32)
    found_above = torch.zeros(1, dtype=torch.float64)
    _choose_digit_kernel[(1,)](weights, above, torch.tensor([target], dtype=torch.float64),
                               found_digit, found_above)
    assert (found_digit.item(), found_above.item()) == (digit, new_above)


def test_disabled_filters_and_strided_rows() -> None:
    """No filter cuts at minus infinity; rows read through a stride give their own cuts."""
    logits = torch.randn(3, 2 * 700, generator=torch.Generator().manual_seed(2))
    strided = logits[:, ::2]
    assert torch.equal(radix_cuts(strided, torch.full((3,), 700), torch.ones(3)),
                       torch.full((3,), float("-inf")))
    top_p = torch.tensor([0.2, 0.7, 0.95])
    assert torch.equal(radix_cuts(strided, None, top_p),
                       sorted_cuts(strided.contiguous(), None, top_p))
    assert radix_cuts(torch.empty(0, 700), None, None).shape == (0,)


def test_bad_input_is_refused() -> None:
    logits = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="float32 logits"):
        radix_cuts(logits.half(), None, None)
    with pytest.raises(ValueError, match="float32 logits"):
        radix_cuts(torch.zeros(64), None, None)
    with pytest.raises(ValueError, match="top_p has shape"):
        radix_cuts(logits, None, torch.ones(3))
    with pytest.raises(ValueError, match="top_k has shape"):
        radix_cuts(logits, torch.ones(2, 1, dtype=torch.int64), None)
    with pytest.raises(ValueError, match="digit_bits"):
        radix_cuts(logits, None, None, digit_bits=3)


def test_the_search_for_each_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU bins; CUDA sorts unless a GPU's timings favour the radix select; any other
    device sorts."""
    assert search_on(torch.device("cpu")) == "binned"
    assert search_on(torch.device("cuda")) == "sort"
    monkeypatch.setattr(top_k_top_p, "RADIX_ON_CUDA", True)
    assert search_on(torch.device("cuda")) == "radix"
    assert search_on(torch.device("meta")) == "sort"
