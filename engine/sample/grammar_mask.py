"""Turns the engine core's grammar bitmask into the sampler's per-row token mask."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from engine.sample.metadata import SamplingMetadata
from engine.structured_output.bitmask import GrammarBitmask


def with_grammar_mask(metadata: SamplingMetadata, sampling_req_ids: Sequence[str],
                      bitmask: GrammarBitmask, vocab_size: int) -> SamplingMetadata:
    """`metadata` with `allowed_token_mask` set for the rows whose request has a grammar
    (other rows allow every token) and no `min_tokens` ban on those rows: the grammar alone
    decides where a constrained output may end."""
    row_of = {req_id: row for row, req_id in enumerate(sampling_req_ids)}
    rows = [row_of[req_id] for req_id in bitmask.req_ids]
    bits = np.unpackbits(bitmask.words.view(np.uint8), axis=1, bitorder="little")
    allowed = torch.ones((len(sampling_req_ids), vocab_size), dtype=torch.bool)
    allowed[rows] = torch.from_numpy(bits[:, :vocab_size].astype(bool))
    constrained = set(rows)
    return dataclasses.replace(
        metadata,
        allowed_token_mask=allowed.to(metadata.temperature.device),
        banned_token_ids=[[] if row in constrained else banned
                          for row, banned in enumerate(metadata.banned_token_ids)],
    )
