"""Top-k and top-p (nucleus) filtering by one logit threshold a row, mostly without a sort.

A row keeps its logits at or above its threshold, the larger of
- top-k's: the row's `k`-th largest logit;
- top-p's, over the distribution top-k leaves: the logit of the first token, in descending
  order, at which the cumulative probability reaches `p`.
Tokens tied with a threshold are all kept, so equal logits (common in bfloat16) are kept or
dropped together, whatever order a sort would put them in.

Both thresholds are read from a row's most likely tokens (its candidates), in descending
order. The whole row is sorted for a top-p alone on a GPU, or on a CPU for a row that needs
over half of it:
- when every row with a top-p has a top-k too, both thresholds lie among each row's
  `max_top_k` largest logits (`torch.topk`, on any device);
- otherwise, under `search="grow"` (on the CPU, where reading a value back costs nothing), a
  row whose top-p is not reached within its `FIRST_CANDIDATES` best tokens (or whose top-k
  is beyond them) searches again among more, until the whole row;
- under `search="sort"` (on a GPU, where deciding that would wait for the device) every row
  is sorted whole.
"""

from __future__ import annotations

from typing import Literal

import torch

FIRST_CANDIDATES = 256
CANDIDATE_GROWTH = 16

CandidateSearch = Literal["grow", "sort"]


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None, max_top_k: int | None,
                      search: CandidateSearch) -> torch.Tensor:
    """`logits` [rows, vocab] with every token below its row's threshold set to minus
    infinity. `top_k` [rows] int64 (the vocabulary's size where disabled), `top_p` [rows]
    float32 (1 where disabled); `max_top_k`: the largest top-k when every row with a top-p
    also has a top-k, else None."""
    threshold = kept_threshold(logits, top_k, top_p, max_top_k, search)
    return logits.masked_fill(logits < threshold, float("-inf"))


def kept_threshold(logits: torch.Tensor, top_k: torch.Tensor | None,
                   top_p: torch.Tensor | None, max_top_k: int | None,
                   search: CandidateSearch) -> torch.Tensor:
    """[rows, 1]: the smallest logit each row keeps (minus infinity: every one)."""
    vocab_size = logits.shape[1]
    if max_top_k is not None:
        candidates = logits.topk(min(max_top_k, vocab_size), dim=-1).values
        return _from_candidates(logits, candidates, top_k, top_p, count_needed=False)[0]
    if search == "sort":
        candidates = logits.sort(dim=-1, descending=True).values
        return _from_candidates(logits, candidates, top_k, top_p, count_needed=False)[0]
    return _grown(logits, top_k, top_p)


def _grown(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
           ) -> torch.Tensor:
    """The thresholds, each row's searched among more candidates until it is found: at least
    `CANDIDATE_GROWTH` times as many, and twice what a row still needs at least; the whole
    row, sorted, once that is over half of it."""
    vocab_size = logits.shape[1]
    threshold = torch.empty((logits.shape[0], 1), dtype=logits.dtype, device=logits.device)
    rows = torch.arange(logits.shape[0], device=logits.device)
    num_candidates = min(FIRST_CANDIDATES, vocab_size)
    while True:
        searched = logits[rows]
        candidates = (searched.sort(dim=-1, descending=True).values
                      if num_candidates == vocab_size
                      else searched.topk(num_candidates, dim=-1).values)
        found, num_needed = _from_candidates(
            searched, candidates, None if top_k is None else top_k[rows],
            None if top_p is None else top_p[rows], count_needed=True)
        threshold[rows] = found
        if num_needed is None or not bool((num_needed > 0).any()):
            return threshold
        rows = rows[num_needed > 0]
        num_wanted = max(num_candidates * CANDIDATE_GROWTH, 2 * int(num_needed.max()))
        num_candidates = vocab_size if num_wanted > vocab_size // 2 else num_wanted


def _from_candidates(logits: torch.Tensor, candidates: torch.Tensor,
                     top_k: torch.Tensor | None, top_p: torch.Tensor | None, *,
                     count_needed: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The thresholds [rows, 1] read from `candidates` [rows, m], each row's m largest logits
    in descending order; with `count_needed`, also [rows] int64: 0 for a row they settle,
    else at least how many candidates it needs (more than m). Without it (None then) the
    caller knows that they settle every row. They never leave a row unsettled when m is the
    vocabulary."""
    count_needed = count_needed and candidates.shape[1] < logits.shape[1]
    kth, num_needed = _top_k_cut(logits, candidates, top_k, count_needed)
    if top_p is None:
        return kth, num_needed
    nucleus, needed_for_p = _top_p_cut(logits, candidates, kth, top_p, count_needed)
    if num_needed is not None and needed_for_p is not None:
        num_needed = torch.maximum(num_needed, needed_for_p)
    return torch.maximum(kth, nucleus), num_needed


def _top_k_cut(logits: torch.Tensor, candidates: torch.Tensor, top_k: torch.Tensor | None,
               count_needed: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's k-th largest logit [rows, 1] (minus infinity where top-k is disabled); with
    `count_needed`, also [rows] int64: its k where that is beyond the candidates (the cut
    read there is not the row's), else 0."""
    num_rows, num_candidates = candidates.shape
    vocab_size = logits.shape[1]
    no_limit = torch.full((num_rows, 1), float("-inf"), dtype=logits.dtype,
                          device=logits.device)
    if top_k is None:
        return no_limit, (torch.zeros(num_rows, dtype=torch.int64, device=logits.device)
                          if count_needed else None)
    k = top_k.clamp(1, vocab_size).unsqueeze(1)
    kth = torch.where(k >= vocab_size, no_limit,
                      candidates.gather(1, k.clamp(max=num_candidates) - 1))
    if not count_needed:
        return kth, None
    beyond = (k < vocab_size) & (k > num_candidates)
    return kth, torch.where(beyond, k, 0).squeeze(1)


def _top_p_cut(logits: torch.Tensor, candidates: torch.Tensor, kth: torch.Tensor,
               top_p: torch.Tensor, count_needed: bool
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's top-p cut [rows, 1] over the tokens at or above `kth` (minus infinity where
    top-p is disabled or not reached within the candidates); with `count_needed`, also
    [rows] int64: where a row that top-p alone bounds is not reached there, at least how many
    candidates it needs (every token left is no more likely than the last candidate), else 0.
    """
    num_candidates = candidates.shape[1]
    vocab_size = logits.shape[1]
    top = candidates[:, :1]
    # Masses relative to the top token's, summed in float64: float32 sums drift with the
    # logits' scale and with the order a batch's threads add them in, enough to move a cut.
    kept_mass = torch.where(logits >= kth, (logits - top).exp(), 0).sum(
        dim=-1, keepdim=True, dtype=torch.float64)
    cumulative = torch.where(candidates >= kth, (candidates - top).exp(), 0).cumsum(
        dim=-1, dtype=torch.float64)
    p = top_p.unsqueeze(1).double()
    num_below = (cumulative < p * kept_mass).sum(dim=-1, keepdim=True)
    not_reached = num_below == num_candidates
    nucleus = torch.where(not_reached | (p >= 1), float("-inf"),
                          candidates.gather(1, num_below.clamp(max=num_candidates - 1)))
    if not count_needed:
        return nucleus, None
    last_mass = (candidates[:, -1:] - top).exp().double()
    missing_mass = (p * kept_mass - cumulative[:, -1:]).clamp(min=0)
    at_least = num_candidates + torch.where(last_mass > 0, missing_mass / last_mass,
                                            vocab_size).ceil().clamp(1, vocab_size)
    unsettled = not_reached & (p < 1) & (kth == float("-inf"))
    num_needed = torch.where(unsettled, at_least.clamp(max=vocab_size), 0)
    return nucleus, num_needed.squeeze(1).to(torch.int64)
