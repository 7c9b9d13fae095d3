"""What the penalties count, per row of the persistent batch, kept on the runner's device.

Presence and frequency penalties read how often each token occurs in a request's output, the
repetition penalty whether it occurs in the prompt or the output. Both live here per batch
row: a penalised request that enters the batch (new or resumed) writes its tokens once, and
every step adds the tokens it sampled from the sampler's device tensor. So a penalised step
neither waits for the tokens of the steps still out nor builds vocabulary-sized arrays on the
host. Rows of requests without penalties are never written; a step with a penalised row
gathers every sampling row, and an unpenalised one's (perhaps stale) counts meet penalties of
0 and 1, which leave its logits as they are.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.model.attention.backend import to_device

_COUNT_DTYPE = torch.int32


class TokenCounts:
    """`output_counts[row, t]`: occurrences of token `t` in the output of the request in
    `row`; `in_prompt[row, t]`: whether `t` occurs in its prompt. Owned by `InputBatch`, which
    calls it as requests enter, leave and move rows. The tables take `num_bytes`: allocated by
    `allocate` (the runner's, at start-up on CUDA, where the pool's sizing reserved them and an
    allocation while serving could wait for the device), else when the first penalised
    request enters."""

    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device) -> None:
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = device
        self._output_counts: torch.Tensor | None = None  # [max_num_reqs, vocab] int32
        self._in_prompt: torch.Tensor | None = None  # [max_num_reqs, vocab] bool

    @staticmethod
    def num_bytes(max_num_reqs: int, vocab_size: int) -> int:
        """Device memory both tables take once allocated."""
        count_bytes = torch.empty((), dtype=_COUNT_DTYPE).element_size()
        return max_num_reqs * vocab_size * (count_bytes + 1)

    def write_row(self, row: int, prompt_token_ids: list[int],
                  output_token_ids: list[int]) -> None:
        """A penalised request enters `row` with these tokens."""
        output_counts, in_prompt = self._tables()
        output_counts[row].zero_()
        in_prompt[row].zero_()
        if prompt_token_ids:
            in_prompt[row].index_fill_(0, self._on_device(prompt_token_ids), True)
        if output_token_ids:
            index = self._on_device(output_token_ids)
            output_counts[row].index_add_(
                0, index, torch.ones(index.shape, dtype=_COUNT_DTYPE, device=self.device))

    def move_row(self, source: int, target: int) -> None:
        """The penalised request in `source` moves to `target` (whose request left)."""
        output_counts, in_prompt = self._tables()
        output_counts[target].copy_(output_counts[source])
        in_prompt[target].copy_(in_prompt[source])

    def add_sampled(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Counts `token_ids[i]` (sampled this step) in the output of `rows[i]`; both on the
        device."""
        output_counts, _ = self._tables()
        # `index_add_` over the flat table, a scatter-add on the device (see
        # `apply_logit_bias`); sampled ids are below the vocabulary size.
        output_counts.view(-1).index_add_(
            0, rows * self.vocab_size + token_ids,
            torch.ones(rows.shape, dtype=_COUNT_DTYPE, device=self.device))

    def gather(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For `rows` (on the device): their output counts [rows, vocab] int32 and whether
        each token occurs in the prompt or the output [rows, vocab] bool."""
        output_counts, in_prompt = self._tables()
        counts = output_counts.index_select(0, rows)
        return counts, in_prompt.index_select(0, rows).logical_or_(counts > 0)

    def allocate(self) -> None:
        """Allocates both tables now (once; later calls do nothing)."""
        self._tables()

    def _tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._output_counts is None or self._in_prompt is None:
            shape = (self.max_num_reqs, self.vocab_size)
            self._output_counts = torch.zeros(shape, dtype=_COUNT_DTYPE, device=self.device)
            self._in_prompt = torch.zeros(shape, dtype=torch.bool, device=self.device)
        return self._output_counts, self._in_prompt

    def _on_device(self, token_ids: list[int]) -> torch.Tensor:
        return to_device(np.array(token_ids, dtype=np.int64), self.device)
