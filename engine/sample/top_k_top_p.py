"""Top-k and top-p (nucleus) filtering by one logit threshold a row, mostly without a sort.

A row keeps its logits at or above its threshold, the larger of
- top-k's: the row's `k`-th largest logit;
- top-p's, over the distribution top-k leaves: the logit of the first token, in descending
  order, at which the cumulative probability reaches `p`.
Tokens tied with a threshold are all kept, so equal logits (common in bfloat16) are kept or
dropped together, whatever order a sort would put them in.

Both thresholds are read from a row's most likely tokens (its candidates), in descending
order:
- when every row with a top-p has a top-k too, both thresholds lie among each row's
  `max_top_k` largest logits (`torch.topk`, on any device);
- otherwise, under `search="binned"` (on the CPU, where reading a value back costs nothing),
  among each row's `FIRST_CANDIDATES` largest; a row they do not settle takes its k largest
  if it has a top-k (both cuts lie there), else finds its top-p cut by binning its
  probability mass by logit (`_top_p_cut_by_bins`): only the tokens of the bin where the
  mass reaches p are sorted, not the row;
- under `search="sort"` (on a GPU, where deciding that would wait for the device) every row
  is sorted whole.
`search_on` picks the search for a device.
"""

from __future__ import annotations

from typing import Literal

import torch

FIRST_CANDIDATES = 256
# A row's logits from its top down to `MASS_BINS_SPAN` (in logits, so nats of probability)
# below it are cut into `NUM_MASS_BINS` bins of equal width; lower ones share the lowest bin
# (e^-40 a token: no mass that moves a cut, whatever the vocabulary).
NUM_MASS_BINS = 4096
MASS_BINS_SPAN = 40.0
# Rows whose crossing bin holds more than this share of the vocabulary (a flat row) sort it
# apart from the others, whose sorts stay as short as their own bins.
CROWDED_BIN_SHARE = 1 / 16

CandidateSearch = Literal["binned", "sort"]


def search_on(device: torch.device) -> CandidateSearch:
    """The search for logits on `device`: `binned` on the CPU, where reading a value back
    costs nothing; elsewhere `sort`, which never waits for the device."""
    return "binned" if device.type == "cpu" else "sort"


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None, max_top_k: int | None,
                      search: CandidateSearch) -> torch.Tensor:
    """`logits` [rows, vocab] (float32, as the sampler's) with every token below its row's
    threshold set to minus infinity. `top_k` [rows] int64 (the vocabulary's size where
    disabled), `top_p` [rows] float32 (1 where disabled); `max_top_k`: the largest top-k
    when every row with a top-p also has a top-k, else None."""
    threshold = _kept_threshold(logits, top_k, top_p, max_top_k, search)
    return logits.masked_fill(logits < threshold, float("-inf"))


def _kept_threshold(logits: torch.Tensor, top_k: torch.Tensor | None,
                    top_p: torch.Tensor | None, max_top_k: int | None,
                    search: CandidateSearch) -> torch.Tensor:
    """[rows, 1]: the smallest logit each row keeps (minus infinity: every one)."""
    vocab_size = logits.shape[1]
    if max_top_k is not None:
        candidates = logits.topk(min(max_top_k, vocab_size), dim=-1).values
        return _from_candidates(logits, candidates, top_k, top_p)[0]
    if search == "sort":
        candidates = logits.sort(dim=-1, descending=True).values
        return _from_candidates(logits, candidates, top_k, top_p)[0]
    return _binned(logits, top_k, top_p)


def _binned(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
            ) -> torch.Tensor:
    """The thresholds, read from each row's first candidates; for the rows they do not
    settle, from the row's k largest logits where it has a top-k, else from its mass binned
    by logit."""
    vocab_size = logits.shape[1]
    candidates = logits.topk(min(FIRST_CANDIDATES, vocab_size), dim=-1).values
    threshold, unsettled = _from_candidates(logits, candidates, top_k, top_p)
    if top_k is not None:
        with_top_k = (unsettled & (top_k < vocab_size)).nonzero().squeeze(1)
        unsettled &= top_k >= vocab_size
        if len(with_top_k):
            row_k, searched = top_k[with_top_k], logits[with_top_k]
            threshold[with_top_k] = _from_candidates(
                searched, searched.topk(int(row_k.max()), dim=-1).values,
                row_k, None if top_p is None else top_p[with_top_k])[0]
    if top_p is not None and bool(unsettled.any()):
        top_p_alone = unsettled.nonzero().squeeze(1)
        threshold[top_p_alone] = _top_p_cut_by_bins(logits[top_p_alone], top_p[top_p_alone])
    return threshold


def _from_candidates(logits: torch.Tensor, candidates: torch.Tensor,
                     top_k: torch.Tensor | None, top_p: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The thresholds [rows, 1] read from `candidates` [rows, m], each row's m largest logits
    in descending order, and [rows] bool: the rows whose thresholds they do not settle (their
    top-k beyond the candidates, or their top-p not reached there); never one when m is the
    vocabulary. (With m every row's top-k, a row whose ties at its k-th logit run past the
    candidates is flagged, though its threshold, that logit, is right.)"""
    kth, k_beyond = _top_k_cut(logits, candidates, top_k)
    if top_p is None:
        return kth, k_beyond
    nucleus, p_beyond = _top_p_cut(logits, candidates, kth, top_p, has_top_k=top_k is not None)
    return torch.maximum(kth, nucleus), k_beyond | p_beyond


def _top_k_cut(logits: torch.Tensor, candidates: torch.Tensor, top_k: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k-th largest logit [rows, 1] (minus infinity where top-k is disabled), and
    [rows] bool: whether its k is beyond the candidates (the cut read there is not the
    row's)."""
    num_rows, num_candidates = candidates.shape
    vocab_size = logits.shape[1]
    no_limit = torch.full((num_rows, 1), float("-inf"), dtype=logits.dtype,
                          device=logits.device)
    if top_k is None:
        return no_limit, torch.zeros(num_rows, dtype=torch.bool, device=logits.device)
    k = top_k.clamp(1, vocab_size).unsqueeze(1)
    kth = torch.where(k >= vocab_size, no_limit,
                      candidates.gather(1, k.clamp(max=num_candidates) - 1))
    return kth, ((k < vocab_size) & (k > num_candidates)).squeeze(1)


def _top_p_cut(logits: torch.Tensor, candidates: torch.Tensor, kth: torch.Tensor,
               top_p: torch.Tensor, *, has_top_k: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's top-p cut [rows, 1] over the tokens at or above `kth` (minus infinity where
    top-p is disabled or not reached within the candidates), and [rows] bool: whether a row
    whose top-p is enabled does not reach it within the candidates.
    `has_top_k` False: `kth` is minus infinity in every row, so no token is masked by it.
    """
    num_candidates = candidates.shape[1]
    top = candidates[:, :1]
    # Masses relative to the top token's, summed in float64: float32 sums drift with the
    # logits' scale and with the order a batch's threads add them in, enough to move a cut.
    masses = (candidates - top).exp()
    if has_top_k:
        masses = torch.where(candidates >= kth, masses, 0)
    cumulative = masses.cumsum(dim=-1, dtype=torch.float64)
    if num_candidates == logits.shape[1]:  # the whole row: its kept mass is the last sum
        kept_mass = cumulative[:, -1:]
    else:
        row_masses = (logits - top).exp()
        if has_top_k:
            row_masses = torch.where(logits >= kth, row_masses, 0)
        kept_mass = row_masses.sum(dim=-1, keepdim=True, dtype=torch.float64)
    p = top_p.unsqueeze(1).double()
    num_below = (cumulative < p * kept_mass).sum(dim=-1, keepdim=True)
    not_reached = (num_below == num_candidates) & (p < 1)
    nucleus = torch.where(not_reached | (p >= 1), float("-inf"),
                          candidates.gather(1, num_below.clamp(max=num_candidates - 1)))
    return nucleus, not_reached.squeeze(1)


def _top_p_cut_by_bins(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Each row's top-p cut [rows, 1], for rows without a top-k whose top-p is below 1,
    found without sorting the row: its masses are summed per bin of logits
    (bins of equal width below its top; a token in a higher bin is never less likely than
    one in a lower), the bin where the mass from the top reaches p is found, and only that
    bin's tokens are sorted to find the cut inside it."""
    logits32 = logits.float()  # a bin index of 4,095 rounds up in half precision
    top = logits32.amax(dim=-1, keepdim=True)
    bins, masses, mass_from = _mass_bins(logits32 - top)
    target = top_p.unsqueeze(1).double() * mass_from[:, :1]
    # The crossing bin is the highest whose mass from the top reaches the target.
    crossing = ((mass_from >= target).sum(dim=-1, keepdim=True) - 1).clamp(min=0)
    above = torch.cat([mass_from[:, 1:], mass_from.new_zeros(len(logits), 1)], dim=-1
                      ).gather(1, crossing)
    in_crossing = (bins == crossing) & (masses > 0)
    num_in_crossing = in_crossing.sum(dim=-1)
    cut = torch.empty_like(top)
    crowded = num_in_crossing > CROWDED_BIN_SHARE * logits.shape[1]
    for group in (crowded, ~crowded):
        rows = group.nonzero().squeeze(1)
        if len(rows):
            cut[rows] = _cut_in_bin(logits32[rows], top[rows], in_crossing[rows],
                                    num_in_crossing[rows], above[rows], target[rows])
    return cut.to(logits.dtype)


def _mass_bins(below_top: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For logits less their row's top [rows, vocab] float32: each token's bin [rows, vocab]
    int64 (0 the lowest), its mass, and [rows, NUM_MASS_BINS] float64 the mass of the bins
    from each one up to the top."""
    num_rows = below_top.shape[0]
    masses = below_top.exp()
    # Truncation floors what the clamp leaves non-negative.
    bins = (below_top * (NUM_MASS_BINS / MASS_BINS_SPAN) + NUM_MASS_BINS).clamp_(
        0, NUM_MASS_BINS - 1).to(torch.int64)
    # Bin b of row r is counted as r * NUM_MASS_BINS + b: one count over the batch, each row's
    # masses added in its own order.
    first_bins = torch.arange(0, num_rows * NUM_MASS_BINS, NUM_MASS_BINS,
                              device=below_top.device).unsqueeze(1)
    bin_masses = torch.bincount((bins + first_bins).flatten(), weights=masses.flatten().double(),
                                minlength=num_rows * NUM_MASS_BINS).view(num_rows, -1)
    return bins, masses, bin_masses.flip(-1).cumsum(dim=-1).flip(-1)


def _cut_in_bin(logits: torch.Tensor, top: torch.Tensor, in_crossing: torch.Tensor,
                num_in_crossing: torch.Tensor, above: torch.Tensor, target: torch.Tensor
                ) -> torch.Tensor:
    """The cuts [rows, 1]: each row's tokens of its crossing bin (`in_crossing`, counted by
    `num_in_crossing`) in descending order, the first at which the mass of the bins `above`
    and of the tokens so far reaches `target`."""
    in_bin = torch.where(in_crossing, logits, float("-inf")).topk(
        max(int(num_in_crossing.max()), 1), dim=-1).values
    cumulative = above + torch.where(in_bin > float("-inf"), (in_bin - top).exp(), 0).cumsum(
        dim=-1, dtype=torch.float64)
    position = (cumulative < target).sum(dim=-1, keepdim=True)
    # Summed in another order than the bins' totals, the bin's own sum may fall short of the
    # target by a rounding: its last token then.
    last = (num_in_crossing.unsqueeze(1) - 1).clamp(min=0)
    return in_bin.gather(1, torch.minimum(position, last))

