"""Top-k and top-p by a threshold a row: the kept sets match their definition, ties kept
whole, whichever way the candidates are found (top-k's bound, grown on the CPU, sorted)."""

from __future__ import annotations

import pytest
import torch

from engine.sample import top_k_top_p
from engine.sample.top_k_top_p import CandidateSearch, apply_top_k_top_p

VOCAB = 1000  # beyond the first candidates, so growing is exercised


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


@pytest.mark.parametrize("search", ["grow", "sort"])
@pytest.mark.parametrize("seed", [0, 1])
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
        for bound in {max_top_k, None}:
            masked = apply_top_k_top_p(logits, k, p, bound, search)
            expected = [reference_kept(logits[row], top_k[row], top_p[row])
                        for row in range(num_rows)]
            assert kept(masked) == expected, (top_k, top_p, bound)
            kept_logits = masked != float("-inf")
            assert torch.equal(masked[kept_logits], logits[kept_logits])


def test_ties_at_either_cut_are_kept_whole() -> None:
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0] + [-9.0] * (VOCAB - 6)])
    by_k = apply_top_k_top_p(logits, torch.tensor([2]), None, 2, "grow")
    assert kept(by_k) == [{0, 1, 2, 3}]
    by_p = apply_top_k_top_p(logits, None, torch.tensor([0.5]), None, "sort")
    assert kept(by_p) == [{0, 1, 2, 3}]  # the mass reaches 0.5 inside the tied group


def test_a_filter_that_keeps_everything_masks_nothing() -> None:
    logits = make_logits(2)
    rows = logits.shape[0]
    for search in ("grow", "sort"):
        masked = apply_top_k_top_p(logits, torch.full((rows,), VOCAB), torch.ones(rows),
                                   None, search)
        assert torch.equal(masked, logits)


def test_the_cpu_grows_the_candidates_only_for_rows_that_need_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A peaked row is settled among the first candidates. A row whose nucleus is a few
    hundred tokens searches again among more, twice what it still needs at least; a flat
    one jumps to its whole row; a top-k beyond the first candidates takes twice its k."""
    searched: list[tuple[int, int]] = []
    from_candidates = top_k_top_p._from_candidates

    def recording(logits: torch.Tensor, candidates: torch.Tensor, *args: object,
                  **kwargs: object) -> tuple[torch.Tensor, torch.Tensor | None]:
        searched.append((candidates.shape[0], candidates.shape[1]))
        return from_candidates(logits, candidates, *args, **kwargs)

    monkeypatch.setattr(top_k_top_p, "_from_candidates", recording)
    monkeypatch.setattr(top_k_top_p, "CANDIDATE_GROWTH", 2)
    vocab = 4000
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(3, vocab, generator=generator) * torch.tensor([[8.0], [0.1], [0.02]])
    logits[1, 400:] -= 10  # the mass on 400 tokens: a nucleus of a few hundred
    peaked_and_wide, peaked_and_flat = logits[[0, 1]], logits[[0, 2]]
    top_p = torch.tensor([0.9, 0.9])

    def grown(rows: torch.Tensor, top_k: torch.Tensor | None, p: torch.Tensor | None
              ) -> list[tuple[int, int]]:
        searched.clear()
        masked = apply_top_k_top_p(rows, top_k, p, None, "grow")
        k = [vocab] * 2 if top_k is None else top_k.tolist()
        assert kept(masked) == [reference_kept(row, kk, pp)
                                for row, kk, pp in zip(rows, k, p.tolist(), strict=True)]
        return list(searched)

    first, second = grown(peaked_and_wide, None, top_p)
    assert first == (2, 256) and second[0] == 1 and 512 <= second[1] < vocab // 2
    assert grown(peaked_and_flat, None, top_p) == [(2, 256), (1, vocab)]
    assert grown(peaked_and_flat, torch.tensor([300, vocab]), torch.tensor([1.0, 1.0])
                 ) == [(2, 256), (1, 600)]
    searched.clear()
    apply_top_k_top_p(logits[:2], torch.tensor([300, 40]), top_p, 300, "sort")
    assert searched == [(2, 300)]  # top-k bounds every row: no sort, whatever the device


@pytest.mark.parametrize("shift", [0.0, 256.0, 1024.0])
def test_the_top_p_cut_holds_at_large_logits(shift: float) -> None:
    """Logits of a few hundred (a low temperature) leave the cut where the definition puts
    it: two tokens, the first 10**-5 short of top-p alone, so both are kept."""
    logits = torch.full((1, VOCAB), float("-inf"))
    logits[0, 0], logits[0, 1] = shift + 2.19, shift
    first = torch.softmax(logits[0, :2].double(), dim=0)[0].item()
    for search in ("grow", "sort"):
        masked = apply_top_k_top_p(logits, None, torch.tensor([first + 1e-5]), None, search)
        assert kept(masked) == [{0, 1}]
        masked = apply_top_k_top_p(logits, None, torch.tensor([first - 1e-5]), None, search)
        assert kept(masked) == [{0}]
