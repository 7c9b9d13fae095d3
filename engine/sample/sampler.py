"""The sampler: logits [rows, vocab] -> one token id per row, plus optional logprobs.

Order of operations: add logit biases (with them the bans of stop tokens not yet allowed),
mask the tokens a structured output's grammar does not allow, apply penalties, then either
take the argmax (greedy rows) or divide by the temperature, apply min-p, top-k and top-p, and
sample.
Sampling uses the exponential race (`argmax(p / q)` with `q ~ Exp(1)`), which draws exactly
one categorical sample per row from noise that can be seeded per row.

Logprobs are those of the raw model distribution (log-softmax of the unprocessed logits), as
in vLLM's default: the sampled token's logprob and rank, and the top-n alternatives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sample.grammar_mask import apply_grammar
from engine.sample.metadata import LogitBias, Penalties, SamplingMetadata
from engine.sample.top_k_top_p import apply_top_k_top_p, search_on

_SEED_MULTIPLIER = 6364136223846793005
_SEED_MODULUS = 2**63


@dataclass(frozen=True)
class SampledLogprobs:
    """Row `i`: `token_ids[i, 0]` is the sampled token, columns 1.. the top alternatives."""

    token_ids: torch.Tensor  # [rows, 1 + max_num_logprobs] int64
    logprobs: torch.Tensor  # [rows, 1 + max_num_logprobs] float32
    sampled_ranks: torch.Tensor  # [rows] int64, 1 = most likely


@dataclass(frozen=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [rows] int64
    logprobs: SampledLogprobs | None


def per_token_seed(seed: int, output_position: int) -> int:
    """The generator seed of a seeded request's `output_position`-th sampled token."""
    return (seed * _SEED_MULTIPLIER + output_position) % _SEED_MODULUS


class Sampler:
    """Stateless but for `generator`, the shared noise source of unseeded rows (owned here)."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        raw_logits = logits
        logits = logits.float()
        if metadata.logit_bias is not None:
            logits = apply_logit_bias(logits, metadata.logit_bias)
        if metadata.grammar is not None:
            logits = apply_grammar(logits, metadata.grammar)
        if metadata.penalties is not None:
            logits = apply_penalties(logits, metadata.penalties)
        sampled = logits.argmax(dim=-1)
        if not metadata.all_greedy:
            random_sampled = self._sample(logits, metadata)
            sampled = torch.where(metadata.temperature == 0, sampled, random_sampled)
        logprobs = None
        if metadata.max_num_logprobs is not None:
            logprobs = gather_logprobs(raw_logits, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def _sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        temperature = torch.where(metadata.temperature == 0, 1.0, metadata.temperature)
        logits = logits / temperature.unsqueeze(1)
        if metadata.min_p is not None:
            logits = apply_min_p(logits, metadata.min_p)
        if metadata.top_k is not None or metadata.top_p is not None:
            logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p,
                                       metadata.max_top_k, search_on(logits.device))
        probs = logits.softmax(dim=-1)
        return (probs / self._exponential_noise(probs, metadata)).argmax(dim=-1)

    def _exponential_noise(self, probs: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        noise = torch.empty_like(probs)
        if any(seed is None for seed in metadata.seeds):
            # One draw for all rows, seeded ones overwritten below: indexing the unseeded
            # rows by a host list would copy it to the device, a copy that waits for it.
            noise.exponential_(generator=self.generator)
        for row, seed in enumerate(metadata.seeds):
            if seed is not None:
                generator = torch.Generator(device=probs.device)
                generator.manual_seed(per_token_seed(seed, metadata.output_positions[row]))
                noise[row].exponential_(generator=generator)
        return noise


def apply_logit_bias(logits: torch.Tensor, bias: LogitBias) -> torch.Tensor:
    """A new tensor: `logits` plus each bias entry, a ban's minus infinity too (the input,
    which may be the raw logits the logprobs are taken from, is left as it is)."""
    # `index_add` over the flat logits, a scatter-add on the device: `index_put(accumulate=
    # True)` takes a sort-based path, whose indices some torch releases range-check on the host.
    # The engine checks every token id against the vocabulary before a request is admitted.
    flat_indices = bias.rows * logits.shape[1] + bias.token_ids
    return logits.reshape(-1).index_add(0, flat_indices, bias.values).view(logits.shape)


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """Repetition penalty divides positive (multiplies negative) logits of seen tokens; then
    `logit -= frequency * count + presence * (count > 0)` over output tokens."""
    repetition = penalties.repetition.unsqueeze(1)
    penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(penalties.seen_mask, penalised, logits)
    counts = penalties.output_counts
    logits = logits - penalties.frequency.unsqueeze(1) * counts
    return logits - penalties.presence.unsqueeze(1) * (counts > 0).to(logits.dtype)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drops tokens whose probability is below `min_p` times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def gather_logprobs(
    logits: torch.Tensor, sampled: torch.Tensor, num_logprobs: int
) -> SampledLogprobs:
    """Logprobs of the sampled tokens and of each row's `num_logprobs` most likely tokens."""
    logprobs = logits.float().log_softmax(dim=-1)
    sampled_logprobs = logprobs.gather(1, sampled.unsqueeze(1))
    ranks = (logprobs > sampled_logprobs).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
    return SampledLogprobs(
        token_ids=torch.cat([sampled.unsqueeze(1), top_ids], dim=1),
        logprobs=torch.cat([sampled_logprobs, top_logprobs], dim=1),
        sampled_ranks=ranks,
    )
