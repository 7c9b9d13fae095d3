"""Top-k and top-p by a threshold a row: the kept sets match their definition, ties kept
whole, whichever way the cuts are found (top-k's bound; on the CPU, the first candidates,
then a top-k's candidates or the mass binned by logit; the sort of every row)."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine.sample import top_k_top_p
from engine.sample.top_k_top_p import CandidateSearch, apply_top_k_top_p

VOCAB = 1000  # beyond the first candidates, so searching again is exercised
SEARCHES: tuple[CandidateSearch, ...] = ("binned", "sort")


def reference_kept(row: torch.Tensor, k: int, p: float) -> set[int]:
    """The definition, token by token in float64: top-k keeps the `k` largest logits and
    their ties; top-p then walks the rest in descending order until the mass reaches `p`,
    and keeps every token tied with the last one taken."""
    values = row.double()
    kept = set(range(len(values)))
    if k < len(values):
        kth = values.sort(descending=True).values[k - 1]
        kept = {token for token in kept if values[token] >= kth}
    if p < 1:
        tokens = sorted(kept, key=lambda token: -values[token].item())
        probs = torch.softmax(values[tokens], dim=0)
        mass, last = 0.0, values[tokens[-1]]
        for token, prob in zip(tokens, probs.tolist(), strict=True):
            mass += prob
            if mass >= p:
                last = values[token]
                break
        kept = {token for token in kept if values[token] >= last}
    return kept


def kept(masked: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(row != float("-inf")).flatten().tolist()) for row in masked]


def make_logits(seed: int) -> torch.Tensor:
    """Rows from peaked to flat, some rounded to bfloat16 (many ties), one with banned tokens."""
    generator = torch.Generator().manual_seed(seed)
    scales = torch.tensor([8.0, 4.0, 2.0, 1.0, 0.3, 0.05, 4.0, 1.0])
    logits = torch.randn(len(scales), VOCAB, generator=generator) * scales.unsqueeze(1)
    logits[6:] = logits[6:].bfloat16().float()
    logits[7, :500] = float("-inf")
    return logits


@pytest.mark.parametrize(("search", "seed"), itertools.product(SEARCHES, [0, 1]))
def test_the_kept_sets_match_the_definition(search: CandidateSearch, seed: int) -> None:
    logits = make_logits(seed)
    num_rows = logits.shape[0]
    cases = [  # (top-k per row, top-p per row); VOCAB and 1.0 disable a row's filter
        ([VOCAB] * num_rows, [0.05, 0.5, 0.9, 0.99, 0.9, 0.5, 0.95, 0.9]),
        ([1, 5, 50, 300, 600, VOCAB, 40, 300], [1.0] * num_rows),
        ([5, 50, 300, VOCAB, 600, 40, 300, 2], [0.9, 0.5, 0.99, 0.95, 1.0, 0.7, 0.9, 0.5]),
    ]
    for top_k, top_p in cases:
        k, p = torch.tensor(top_k), torch.tensor(top_p)
        every_top_p_has_top_k = all(kk < VOCAB for kk, pp in zip(top_k, top_p, strict=True)
                                    if pp < 1)
        max_top_k = (max(kk for kk in top_k if kk < VOCAB) if every_top_p_has_top_k else None)
        # A filter no row uses may also come as None (the sampler's metadata then has none).
        filters = [(k, p)]
        if all(kk >= VOCAB for kk in top_k):
            filters.append((None, p))
        if all(pp >= 1 for pp in top_p):
            filters.append((k, None))
        for (k_or_none, p_or_none), bound in itertools.product(filters, {max_top_k, None}):
            masked = apply_top_k_top_p(logits, k_or_none, p_or_none, bound, search)
            expected = [reference_kept(logits[row], top_k[row], top_p[row])
                        for row in range(num_rows)]
            assert kept(masked) == expected, (top_k, top_p, bound)
            kept_logits = masked != float("-inf")
            assert torch.equal(masked[kept_logits], logits[kept_logits])


def test_ties_at_either_cut_are_kept_whole() -> None:
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0] + [-9.0] * (VOCAB - 6)])
    by_k = apply_top_k_top_p(logits, torch.tensor([2]), None, 2, "binned")
    assert kept(by_k) == [{0, 1, 2, 3}]
    for search in SEARCHES[1:]:
        by_p = apply_top_k_top_p(logits, None, torch.tensor([0.5]), None, search)
        assert kept(by_p) == [{0, 1, 2, 3}]  # the mass reaches 0.5 inside the tied group
        by_k = apply_top_k_top_p(logits, torch.tensor([2]), None, None, search)
        assert kept(by_k) == [{0, 1, 2, 3}]


def test_a_filter_that_keeps_everything_masks_nothing() -> None:
    logits = make_logits(2)
    rows = logits.shape[0]
    for search in SEARCHES:
        masked = apply_top_k_top_p(logits, torch.full((rows,), VOCAB), torch.ones(rows),
                                   None, search)
        assert torch.equal(masked, logits)


def test_the_cpu_searches_again_only_the_rows_its_first_candidates_do_not_settle(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A peaked row is settled among the first candidates. A row whose top-k is beyond them
    is searched again among its k largest; a row with a wider nucleus and no top-k, by bins
    (only the crossing bin's tokens sorted). Under `sort` or a bound on every row's top-k,
    nothing is searched again."""
    searched: list[tuple[str, int, int]] = []
    by_bins, from_candidates = top_k_top_p._top_p_cut_by_bins, top_k_top_p._from_candidates

    def binned(logits: torch.Tensor, *args: object) -> torch.Tensor:
        searched.append(("bins", *logits.shape))
        return by_bins(logits, *args)

    def candidates(logits: torch.Tensor, found: torch.Tensor, *args: object
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        searched.append(("candidates", *found.shape))
        return from_candidates(logits, found, *args)

    monkeypatch.setattr(top_k_top_p, "_top_p_cut_by_bins", binned)
    monkeypatch.setattr(top_k_top_p, "_from_candidates", candidates)
    vocab = 4000
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(3, vocab, generator=generator) * torch.tensor([[8.0], [0.5], [0.02]])

    def filtered(rows: torch.Tensor, top_k: list[int] | None, top_p: list[float],
                 search: CandidateSearch = "binned", bound: int | None = None
                 ) -> list[tuple[str, int, int]]:
        searched.clear()
        k = [vocab] * len(rows) if top_k is None else top_k
        masked = apply_top_k_top_p(rows, None if top_k is None else torch.tensor(top_k),
                                   torch.tensor(top_p), bound, search)
        assert kept(masked) == [reference_kept(row, kk, pp)
                                for row, kk, pp in zip(rows, k, top_p, strict=True)]
        return list(searched)

    first = ("candidates", 3, 256)
    assert filtered(logits[[0]], None, [0.9]) == [("candidates", 1, 256)]
    assert filtered(logits, None, [0.9, 0.9, 0.9]) == [first, ("bins", 2, vocab)]
    assert filtered(logits, [300, vocab, 2], [1.0, 1.0, 1.0]) == [first, ("candidates", 1, 300)]
    assert filtered(logits, [600, vocab, 2], [0.9, 0.5, 0.5]) == [
        first, ("candidates", 1, 600), ("bins", 1, vocab)]
    assert filtered(logits, None, [0.9, 0.9, 0.9], "sort") == [("candidates", 3, vocab)]
    assert filtered(logits, [300, 40, 2], [0.9, 0.9, 0.9], "binned", 300) == [
        ("candidates", 3, 300)]


def test_the_bins_find_the_cut_in_any_row_that_reaches_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows whose nucleus outgrows the first candidates, each cut as the definition puts
    it: a flat row (its crossing bin most of the row, so sorted apart from the others),
    bfloat16 ties, a row spread over more than the bins' span (its lowest bin shared) and
    one with banned tokens; then a flat row of 20,000 tokens at p 0.5, whose cut bin sums
    in float32 would move by a token."""
    group_sizes: list[int] = []
    cut_in_bin = top_k_top_p._cut_in_bin

    def recording(logits: torch.Tensor, *args: object) -> torch.Tensor:
        group_sizes.append(logits.shape[0])
        return cut_in_bin(logits, *args)

    monkeypatch.setattr(top_k_top_p, "_cut_in_bin", recording)
    vocab = 3000
    generator = torch.Generator().manual_seed(5)
    flat = torch.randn(vocab, generator=generator) * 1e-4
    ties = (torch.randn(vocab, generator=generator) * 0.02).bfloat16().float()
    wide = torch.linspace(0.0, -60.0, vocab)[torch.randperm(vocab, generator=generator)]
    banned = torch.randn(vocab, generator=generator)
    banned[::3] = float("-inf")
    logits = torch.stack([flat, ties, wide, banned])
    top_p = [0.7, 0.3, 0.999, 0.95]
    masked = apply_top_k_top_p(logits, None, torch.tensor(top_p), None, "binned")
    assert kept(masked) == [{token for token in reference_kept(row, vocab, p)
                             if row[token] > float("-inf")}
                            for row, p in zip(logits, top_p, strict=True)]
    assert group_sizes == [2, 2]  # the flat rows, then the others

    wider = torch.randn(1, 20000, generator=torch.Generator().manual_seed(0)) * 1e-4
    masked = apply_top_k_top_p(wider, None, torch.tensor([0.5]), None, "binned")
    assert kept(masked) == [reference_kept(wider[0], 20000, 0.5)]


@pytest.mark.parametrize("shift", [0.0, 256.0, 1024.0])
def test_the_top_p_cut_holds_at_large_logits(shift: float) -> None:
    """Logits of a few hundred (a low temperature) leave the cut where the definition puts
    it: two tokens, the first 10**-5 short of top-p alone, so both are kept."""
    logits = torch.full((1, VOCAB), float("-inf"))
    logits[0, 0], logits[0, 1] = shift + 2.19, shift
    first = torch.softmax(logits[0, :2].double(), dim=0)[0].item()
    for search in SEARCHES:
        masked = apply_top_k_top_p(logits, None, torch.tensor([first + 1e-5]), None, search)
        assert kept(masked) == [{0, 1}]
        masked = apply_top_k_top_p(logits, None, torch.tensor([first - 1e-5]), None, search)
        assert kept(masked) == [{0}]


def test_the_cpu_bins_its_search_and_a_device_sorts() -> None:
    # Reading back which rows need more costs nothing on the CPU; on a device it would wait.
    assert top_k_top_p.search_on(torch.device("cpu")) == "binned"
    assert top_k_top_p.search_on(torch.device("cuda")) == "sort"
    assert top_k_top_p.search_on(torch.device("meta")) == "sort"
