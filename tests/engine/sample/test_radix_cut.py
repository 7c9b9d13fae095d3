"""The radix select of `radix_cut` (under Triton's interpreter): each cut is exactly the sort
path's, over the order of every kind of float32, rows longer than one sum of chunks, and
flat rows whose cut a rounding could move; bad input is refused."""

from __future__ import annotations

import pytest
import torch

from engine.sample import radix_cut, top_k_top_p
from engine.sample.radix_cut import radix_cuts
from engine.sample.top_k_top_p import search_on


def sorted_cuts(logits: torch.Tensor, top_k: torch.Tensor | None,
                top_p: torch.Tensor | None) -> torch.Tensor:
    return top_k_top_p._kept_threshold(logits, top_k, top_p, None, "sort").squeeze(1)


def test_top_k_cuts_follow_the_order_of_every_kind_of_float() -> None:
    """Every k of a row holding minus infinity, both zeros, subnormals, the extremes and
    values of both signs: the k-th largest value, whatever its bits."""
    values = torch.tensor([float("-inf"), -3.0e38, -1.0, -1.0e-40, -0.0, 0.0, 1.0e-45, 1.0e-40,
                           0.5, 1.0, 1.5, 3.0e38])
    row = values[torch.randperm(len(values), generator=torch.Generator().manual_seed(0))]
    ks = torch.arange(1, len(values) + 1)
    logits = row.repeat(len(ks), 1)
    cuts = radix_cuts(logits, ks, None)
    descending = values.flip(0)
    for k, cut in zip(ks.tolist(), cuts.tolist(), strict=True):
        # Both zeros compare equal: either is the right cut at k 7 and 8.
        assert cut == descending[k - 1].item() or (cut == 0.0 and descending[k - 1] == 0.0)
    assert cuts[-1] == float("-inf")  # k 12, the whole row


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
    top_k = torch.tensor([40, 3000, 100, vocab, 1])
    top_p = torch.tensor([0.9, 0.999, 0.5, 0.95, 0.3])
    for k, p in ((None, top_p), (top_k, top_p)):
        assert torch.equal(radix_cuts(logits, k, p), sorted_cuts(logits, k, p)), (k, p)


def test_a_flat_row_keeps_its_cut_where_float64_sums_put_it() -> None:
    """20,000 tokens within 1e-4 of each other at p 0.5: each token a 20,000th of the mass,
    so a sum off by a token's mass would move the cut."""
    wide = torch.randn(1, 20000, generator=torch.Generator().manual_seed(0)) * 1e-4
    top_p = torch.tensor([0.5])
    assert torch.equal(radix_cuts(wide, None, top_p), sorted_cuts(wide, None, top_p))


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


def test_the_search_for_each_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU bins; CUDA sorts until a GPU has timed the radix select, then takes it."""
    assert search_on(torch.device("cpu")) == "binned"
    assert search_on(torch.device("cuda")) == "sort"
    monkeypatch.setattr(top_k_top_p, "RADIX_ON_CUDA", True)
    assert search_on(torch.device("cuda")) == "radix"
    assert radix_cut._BLOCK * radix_cut._CHUNKS_PER_SUM < 5000  # the test above spans sums
