"""The token bitmask of one step's constrained requests: built by the core's
`StructuredOutputManager`, carried by `SchedulerOutput`, applied by the model runner's sampler."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class GrammarBitmask:
    """The allowed tokens of the requests that sample this step and have a grammar.

    `words[i]` belongs to `req_ids[i]`: int32 words over the vocabulary, bit `t % 32` of word
    `t // 32` set when token `t` may be sampled. Built by the core, read by the model runner.
    """

    req_ids: list[str]
    words: np.ndarray  # [len(req_ids), ceil(vocab_size / 32)] int32
