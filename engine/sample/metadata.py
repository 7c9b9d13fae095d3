"""Per-step sampling inputs of a batch, one row per request that samples this step."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Penalties:
    """OpenAI presence/frequency penalties (on output tokens) and the multiplicative repetition
    penalty (on prompt and output tokens), with the token counts they read."""

    presence: torch.Tensor  # [rows] float32
    frequency: torch.Tensor  # [rows] float32
    repetition: torch.Tensor  # [rows] float32
    output_counts: torch.Tensor  # [rows, vocab] float32: occurrences in the output so far
    seen_mask: torch.Tensor  # [rows, vocab] bool: occurs in the prompt or the output


@dataclass(frozen=True)
class LogitBias:
    """Additive logit biases as sparse entries: `values[e]` is added to the logit of token
    `token_ids[e]` in row `rows[e]`. Only rows with a bias have entries."""

    rows: torch.Tensor  # [entries] int64
    token_ids: torch.Tensor  # [entries] int64
    values: torch.Tensor  # [entries] float32


@dataclass(frozen=True)
class SamplingMetadata:
    """What the sampler needs beside the logits.

    Filters that no row uses are `None`, so a plain greedy or plain temperature batch does no
    extra work. `seeds[i]` is row `i`'s request seed (`None`: draw from the runner's shared
    generator); `output_positions[i]` is the index of the token row `i` samples, so a seeded
    request draws the same randomness for its n-th token whatever the batch or preemptions.
    `banned_token_ids[i]` lists tokens row `i` may not produce yet (EOS and stop ids before
    `min_tokens`). `logit_bias` is `None` when no row has one.
    """

    temperature: torch.Tensor  # [rows] float32, 0 means greedy
    all_greedy: bool
    top_k: torch.Tensor | None  # [rows] int64, vocab size where disabled
    top_p: torch.Tensor | None  # [rows] float32
    min_p: torch.Tensor | None  # [rows] float32
    seeds: list[int | None]
    output_positions: list[int]
    penalties: Penalties | None
    banned_token_ids: list[list[int]]
    max_num_logprobs: int | None
    logit_bias: LogitBias | None = None
    # [rows, vocab] bool: the tokens each row's grammar allows (None: no row has a grammar);
    # set by the model runner from the step's grammar bitmask, after the batch built the rest.
    allowed_token_mask: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return len(self.seeds)
