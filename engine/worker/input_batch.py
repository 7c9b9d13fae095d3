"""The persistent batch: the runner's per-request state, kept in rows across steps.

A request occupies one row from the step it is scheduled as new (or resumed) until it is
finished or preempted. Rows stay dense (0..num_reqs-1): removing a request moves the last row
into the hole. Token ids, block tables and sampling parameters live in numpy arrays indexed by
row, so building a step's inputs is a handful of vectorised gathers rather than a Python loop
over tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.model.attention.backend import to_device
from engine.sample.metadata import LogitBias, Penalties, SamplingMetadata
from engine.sampling_params import SamplingParams
from engine.scheduler.output import NewRequestData


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
                 vocab_size: int):
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int64)
        self.rows: list[RowState] = []
        self.row_of: dict[str, int] = {}
        self.num_penalised_rows = 0  # rows whose sampling counts their tokens (penalties)

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
        self.num_penalised_rows += params.has_penalties
        self.append_blocks(new.req_id, new.block_ids)

    def remove(self, req_id: str) -> None:
        """Drops a request's row, moving the last row into its place."""
        row = self.row_of.pop(req_id, None)
        if row is None:
            return
        self.num_penalised_rows -= self.rows[row].sampling_params.has_penalties
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
        self.rows.pop()

    def append_blocks(self, req_id: str, block_ids: list[int]) -> None:
        state = self.rows[self.row_of[req_id]]
        start = len(state.block_ids)
        state.block_ids.extend(block_ids)
        self.block_table[self.row_of[req_id], start : len(state.block_ids)] = block_ids

    def append_token(self, row: int, token_id: int) -> None:
        self.token_ids[row, self.num_tokens[row]] = token_id
        self.num_tokens[row] += 1

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

    def output_token_ids(self, row: int) -> np.ndarray:
        return self.token_ids[row, self.rows[row].num_prompt_tokens : self.num_tokens[row]]

    def sampling_metadata(self, rows: list[int], device: torch.device) -> SamplingMetadata:
        """Sampling inputs for `rows`, in that order (the rows that sample this step)."""
        params = [self.rows[row].sampling_params for row in rows]
        num_outputs = [int(self.num_tokens[row]) - self.rows[row].num_prompt_tokens
                       for row in rows]

        def column(values: list[float], dtype: type[np.generic] = np.float32) -> torch.Tensor:
            return to_device(np.array(values, dtype=dtype), device)

        temperature = column([p.temperature for p in params])
        return SamplingMetadata(
            temperature=temperature,
            all_greedy=all(p.is_greedy for p in params),
            top_k=column([p.top_k or self.vocab_size for p in params], np.int64)
            if any(p.top_k for p in params) else None,
            top_p=column([p.top_p for p in params]) if any(p.top_p < 1 for p in params) else None,
            min_p=column([p.min_p for p in params]) if any(p.min_p for p in params) else None,
            seeds=[p.seed for p in params],
            output_positions=num_outputs,
            penalties=self._penalties(rows, params, device),
            banned_token_ids=[
                self.rows[row].banned_until_min_tokens if count < p.min_tokens else []
                for row, p, count in zip(rows, params, num_outputs, strict=True)
            ],
            max_num_logprobs=max(
                (p.logprobs for p in params if p.logprobs is not None), default=None
            ),
            logit_bias=_logit_bias(params, device),
        )

    def _penalties(
        self, rows: list[int], params: list[SamplingParams], device: torch.device
    ) -> Penalties | None:
        if not any(p.has_penalties for p in params):
            return None
        output_counts = np.zeros((len(rows), self.vocab_size), dtype=np.float32)
        seen = np.zeros((len(rows), self.vocab_size), dtype=bool)
        for index, row in enumerate(rows):
            np.add.at(output_counts[index], self.output_token_ids(row), 1.0)
            seen[index, self.token_ids[row, : self.num_tokens[row]]] = True
        return Penalties(
            presence=torch.tensor([p.presence_penalty for p in params], device=device),
            frequency=torch.tensor([p.frequency_penalty for p in params], device=device),
            repetition=torch.tensor([p.repetition_penalty for p in params], device=device),
            output_counts=torch.from_numpy(output_counts).to(device),
            seen_mask=torch.from_numpy(seen).to(device),
        )


def _logit_bias(params: list[SamplingParams], device: torch.device) -> LogitBias | None:
    """The sparse bias entries of the rows that have one; None when no row has."""
    entries = [(index, token_id, bias) for index, p in enumerate(params)
               for token_id, bias in p.logit_bias]
    if not entries:
        return None
    rows, token_ids, values = zip(*entries, strict=True)
    return LogitBias(
        rows=to_device(np.array(rows, dtype=np.int64), device),
        token_ids=to_device(np.array(token_ids, dtype=np.int64), device),
        values=to_device(np.array(values, dtype=np.float32), device),
    )
