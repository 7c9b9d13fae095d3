"""Per-step sampling inputs of a batch, one row per request that samples this step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import MAX_LOGPROBS


@dataclass(frozen=True)
class Penalties:
    """OpenAI presence/frequency penalties (on output tokens) and the multiplicative repetition
    penalty (on prompt and output tokens), with the token counts they read."""

    presence: torch.Tensor  # [rows] float32
    frequency: torch.Tensor  # [rows] float32
    repetition: torch.Tensor  # [rows] float32
    output_counts: torch.Tensor  # [rows, vocab] int32: occurrences in the output so far
    seen_mask: torch.Tensor  # [rows, vocab] bool: occurs in the prompt or the output


@dataclass(frozen=True)
class LogitBias:
    """Additive logit biases as sparse entries: `values[e]` is added to the logit of token
    `token_ids[e]` in row `rows[e]`. Only rows with a bias or a ban have entries; a ban (a stop
    token before `min_tokens`) is an entry of minus infinity."""

    rows: torch.Tensor  # [entries] int64
    token_ids: torch.Tensor  # [entries] int64
    values: torch.Tensor  # [entries] float32


@dataclass(frozen=True)
class GrammarRows:
    """The rows a structured output's grammar constrains this step, with their allowed tokens
    packed as the grammar bitmask packs them: bit `t % 32` of `words[k, t // 32]` is set when
    row `rows[k]` may sample token `t`. Unpacked on the device by the sampler."""

    rows: torch.Tensor  # [constrained rows] int64
    words: torch.Tensor  # [constrained rows, ceil(vocab / 32)] int32


@dataclass(frozen=True)
class SamplingMetadata:
    """What the sampler needs beside the logits.

    Filters that no row uses are `None`, so a plain greedy or plain temperature batch does no
    extra work. Every tensor is on the sampler's device already (copied without waiting for
    it); the lists stay on the host. `seeds[i]` is row `i`'s request seed (`None`: draw from the
    runner's shared generator); `output_positions[i]` is the index of the token row `i`
    samples, so a seeded request draws the same randomness for its n-th token whatever the
    batch or preemptions. `logit_bias` holds the requests' biases and their bans (EOS and stop
    ids before `min_tokens`, except in rows a grammar constrains: there the grammar alone
    decides where the output may end); `None` when no row has either. `max_top_k` is the
    largest top-k (at most the vocabulary's size) when every row with a top-p has a top-k
    too, so that both of each row's cuts lie among its `max_top_k` largest logits
    (`top_k_top_p.py`); `None` when some row's top-p has no top-k, or no row has a top-k.
    """

    temperature: torch.Tensor  # [rows] float32, 0 means greedy
    all_greedy: bool
    top_k: torch.Tensor | None  # [rows] int64, vocab size where disabled
    top_p: torch.Tensor | None  # [rows] float32, 1 where disabled
    max_top_k: int | None
    min_p: torch.Tensor | None  # [rows] float32
    seeds: list[int | None]
    output_positions: list[int]
    penalties: Penalties | None
    max_num_logprobs: int | None
    logit_bias: LogitBias | None = None
    grammar: GrammarRows | None = None  # None: no row has a grammar

    @classmethod
    def worst_case(cls, num_rows: int, vocab_size: int, device: torch.device
                   ) -> SamplingMetadata:
        """`num_rows` rows that ask for everything the sampler allocates memory for:
        temperature, top-k, top-p (no row's top-k bounding it, so that a GPU sorts the whole
        vocabulary) and min-p, penalties, a logit bias, a grammar and the most logprobs (the
        runner's memory profile samples them)."""
        ones = torch.ones(num_rows, device=device)
        rows = torch.arange(num_rows, device=device)
        shape = (num_rows, vocab_size)
        return cls(
            temperature=ones, all_greedy=False,
            top_k=torch.full((num_rows,), vocab_size, dtype=torch.int64, device=device),
            top_p=ones * 0.9, max_top_k=None, min_p=ones * 0.1,
            seeds=[None] * num_rows, output_positions=[0] * num_rows,
            penalties=Penalties(
                presence=ones, frequency=ones, repetition=ones,
                output_counts=torch.zeros(shape, dtype=torch.int32, device=device),
                seen_mask=torch.zeros(shape, dtype=torch.bool, device=device)),
            max_num_logprobs=min(MAX_LOGPROBS, vocab_size),
            logit_bias=LogitBias(rows=rows, token_ids=torch.zeros_like(rows), values=ones),
            grammar=GrammarRows(rows=rows, words=torch.full(
                (num_rows, -(-vocab_size // 32)), -1, dtype=torch.int32, device=device)),
        )
