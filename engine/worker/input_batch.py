"""The persistent batch: the runner's per-request state, kept in rows across steps.

A request occupies one row from the step it is scheduled as new (or resumed) until it is
finished or preempted. Rows stay dense (0..num_reqs-1): removing a request moves the last row
into the hole. Token ids, block tables and sampling parameters live in numpy arrays indexed by
row, so building a step's inputs is a handful of vectorised gathers rather than a Python loop
over tokens. What penalties count per row lives on the device (`token_counts.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.model.attention.backend import to_device
from engine.sample.metadata import GrammarRows, LogitBias, Penalties, SamplingMetadata
from engine.sampling_params import SamplingParams
from engine.scheduler.output import NewRequestData
from engine.structured_output.bitmask import GrammarBitmask
from engine.worker.token_counts import TokenCounts


@dataclass
class RowState:
    """Per-request state that is not an array column: the parameters and the block list."""

    req_id: str
    sampling_params: SamplingParams
    block_ids: list[int]
    num_prompt_tokens: int
    banned_until_min_tokens: list[int]


class InputBatch:
    """Rows of request state; the runner owns it and mutates it between forward passes."""

    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int,
                 vocab_size: int, device: torch.device):
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = device  # where the sampling inputs and the penalties' counts go
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int64)
        self.rows: list[RowState] = []
        self.row_of: dict[str, int] = {}
        self.token_counts = TokenCounts(max_num_reqs, vocab_size, device)

    @property
    def num_reqs(self) -> int:
        return len(self.rows)

    def add(self, new: NewRequestData) -> None:
        """A new or resumed request; its tokens so far are its prompt plus `output_token_ids`."""
        row = len(self.rows)
        assert new.req_id not in self.row_of and row < self.max_num_reqs
        tokens = new.prompt_token_ids + new.output_token_ids
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_computed_tokens[row] = new.num_computed_tokens
        params = new.sampling_params
        banned = list(params.stop_token_ids)
        if new.eos_token_id is not None and not params.ignore_eos:
            banned.append(new.eos_token_id)
        self.rows.append(RowState(new.req_id, params, [], len(new.prompt_token_ids), banned))
        self.row_of[new.req_id] = row
        if params.has_penalties:
            self.token_counts.write_row(row, new.prompt_token_ids, new.output_token_ids)
        self.append_blocks(new.req_id, new.block_ids)

    def remove(self, req_id: str) -> None:
        """Drops a request's row, moving the last row into its place."""
        row = self.row_of.pop(req_id, None)
        if row is None:
            return
        last = len(self.rows) - 1
        if row != last:
            moved = self.rows[last]
            self.rows[row] = moved
            self.row_of[moved.req_id] = row
            count = int(self.num_tokens[last])
            self.token_ids[row, :count] = self.token_ids[last, :count]
            for column in (self.num_tokens, self.num_computed_tokens):
                column[row] = column[last]
            self.block_table[row, : len(moved.block_ids)] = moved.block_ids
            if moved.sampling_params.has_penalties:
                self.token_counts.move_row(last, row)
        self.rows.pop()

    def append_blocks(self, req_id: str, block_ids: list[int]) -> None:
        state = self.rows[self.row_of[req_id]]
        start = len(state.block_ids)
        state.block_ids.extend(block_ids)
        self.block_table[self.row_of[req_id], start : len(state.block_ids)] = block_ids

    def append_placeholders(self, rows: np.ndarray) -> np.ndarray:
        """Appends a token whose id is not known yet (0 until `set_token`) to each of `rows`
        (distinct); returns the positions they take."""
        positions = self.num_tokens[rows].copy()
        self.token_ids[rows, positions] = 0
        self.num_tokens[rows] += 1
        return positions

    def set_token(self, row: int, position: int, token_id: int) -> None:
        """Fills in a placeholder appended by `append_placeholders`."""
        self.token_ids[row, position] = token_id

    def count_sampled(self, rows: list[int], sampled: torch.Tensor) -> None:
        """Adds the tokens a step sampled (`sampled[i]`, on the device, for batch row
        `rows[i]`) to the penalties' counts of the penalised rows among them."""
        indices = [index for index, row in enumerate(rows)
                   if self.rows[row].sampling_params.has_penalties]
        if indices:
            self.token_counts.add_sampled(
                to_device(np.array([rows[index] for index in indices]), self.device, np.int64),
                sampled[to_device(np.array(indices), self.device, np.int64)])

    def sampling_metadata(self, rows: list[int], grammar: GrammarBitmask | None = None
                          ) -> SamplingMetadata:
        """Sampling inputs for `rows`, in that order (the rows that sample this step), with
        the rows of `grammar`'s requests constrained (each must be in `rows`). Every copy to
        the device is asynchronous: nothing here waits for the device."""
        params = [self.rows[row].sampling_params for row in rows]
        num_outputs = [int(self.num_tokens[row]) - self.rows[row].num_prompt_tokens
                       for row in rows]
        constrained = [] if grammar is None else _indices_of(
            [self.row_of[req_id] for req_id in grammar.req_ids], rows)

        def column(values: list[float], dtype: type[np.generic] = np.float32) -> torch.Tensor:
            return to_device(np.array(values, dtype=dtype), self.device)

        constrained_set = set(constrained)
        bans = [self.rows[row].banned_until_min_tokens
                if count < p.min_tokens and index not in constrained_set else []
                for index, (row, p, count) in enumerate(zip(rows, params, num_outputs,
                                                            strict=True))]
        return SamplingMetadata(
            temperature=column([p.temperature for p in params]),
            all_greedy=all(p.is_greedy for p in params),
            top_k=column([p.top_k or self.vocab_size for p in params], np.int64)
            if any(p.top_k for p in params) else None,
            top_p=column([p.top_p for p in params]) if any(p.top_p < 1 for p in params) else None,
            max_top_k=_max_top_k(params, self.vocab_size),
            min_p=column([p.min_p for p in params]) if any(p.min_p for p in params) else None,
            seeds=[p.seed for p in params],
            output_positions=num_outputs,
            penalties=self._penalties(rows, params, column),
            max_num_logprobs=max(
                (p.logprobs for p in params if p.logprobs is not None), default=None
            ),
            logit_bias=_logit_bias(params, bans, self.device),
            grammar=None if grammar is None else GrammarRows(
                rows=to_device(np.array(constrained), self.device, np.int64),
                words=to_device(grammar.words, self.device, np.int32)),
        )

    def _penalties(self, rows: list[int], params: list[SamplingParams],
                   column: Callable[[list[float]], torch.Tensor]) -> Penalties | None:
        if not any(p.has_penalties for p in params):
            return None
        output_counts, seen = self.token_counts.gather(
            to_device(np.array(rows), self.device, np.int64))
        return Penalties(
            presence=column([p.presence_penalty for p in params]),
            frequency=column([p.frequency_penalty for p in params]),
            repetition=column([p.repetition_penalty for p in params]),
            output_counts=output_counts,
            seen_mask=seen,
        )


def _max_top_k(params: list[SamplingParams], vocab_size: int) -> int | None:
    """The largest top-k of `params` when every one with a top-p has a top-k too; else (or
    with no top-k at all) None."""
    if any(p.top_p < 1 and not p.top_k for p in params):
        return None
    return max((min(p.top_k, vocab_size) for p in params if p.top_k), default=None)


def _indices_of(items: list[int], sequence: list[int]) -> list[int]:
    """The index in `sequence` of each of `items` (each must be in it)."""
    index_of = {item: index for index, item in enumerate(sequence)}
    return [index_of[item] for item in items]


def _logit_bias(params: list[SamplingParams], bans: list[list[int]], device: torch.device
                ) -> LogitBias | None:
    """The sparse entries of the rows' biases and bans (minus infinity); None when no row has
    either."""
    entries = [(index, token_id, bias) for index, p in enumerate(params)
               for token_id, bias in p.logit_bias]
    entries += [(index, token_id, -np.inf) for index, banned in enumerate(bans)
                for token_id in banned]
    if not entries:
        return None
    rows, token_ids, values = zip(*entries, strict=True)
    return LogitBias(
        rows=to_device(np.array(rows, dtype=np.int64), device),
        token_ids=to_device(np.array(token_ids, dtype=np.int64), device),
        values=to_device(np.array(values, dtype=np.float32), device),
    )
