"""A linear cost model of one engine step, with coefficients measured on a device.

A step's batch is, per scheduled request, `(num_computed_tokens, num_new_tokens)`. Its cost
is a sum of non-negative terms, each a coefficient times a count of the batch:

- a fixed cost per step that computes anything (launches, sampling, the engine loop);
- per prefill token: new tokens of multi-token queries (a prompt, or a chunk of one);
- per prefill query: each multi-token query (its own attention call and mask);
- per decode query: each single-token query;
- per context token: the KV the step reads, `num_computed + num_new` of every request;
- per attention pair: the (query, key) pairs of multi-token queries under a causal mask,
  `num_new * num_computed + num_new * (num_new + 1) / 2` each.

`engine.executor.measured` prices simulated steps with it; `continuum bench calibrate` fits
the coefficients to the steps of real traces (`eval.calibrate`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class StepCounts:
    """What a batch holds, as the cost terms count it."""

    num_steps: int
    num_prefill_tokens: int
    num_prefill_queries: int
    num_decode_queries: int
    num_context_tokens: int
    num_attention_pairs: int

    @classmethod
    def of(cls, batch: Iterable[tuple[int, int]]) -> StepCounts:
        """The counts of one step's `(num_computed_tokens, num_new_tokens)` pairs; an empty
        batch (or one computing no token) counts nothing, not even the step."""
        prefill_tokens = prefill_queries = decode_queries = context = pairs = 0
        for num_computed, num_new in batch:
            if num_new <= 0:
                continue
            context += num_computed + num_new
            if num_new == 1:
                decode_queries += 1
                continue
            prefill_tokens += num_new
            prefill_queries += 1
            pairs += num_new * num_computed + num_new * (num_new + 1) // 2
        computes = prefill_queries + decode_queries > 0
        return cls(int(computes), prefill_tokens, prefill_queries, decode_queries, context,
                   pairs)

    def as_tuple(self) -> tuple[int, ...]:
        """The counts in the order of `StepCostModel`'s coefficients."""
        return tuple(getattr(self, item.name) for item in fields(self))


@dataclass(frozen=True)
class StepCostModel:
    """Seconds of one step: each coefficient (seconds per unit) times its count in
    `StepCounts`, summed. Every coefficient is finite and >= 0."""

    step_overhead_s: float
    prefill_token_s: float
    prefill_query_s: float
    decode_query_s: float
    context_token_s: float
    attention_pair_s: float

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if not (isinstance(value, int | float) and 0.0 <= value < math.inf):
                raise ValueError(f"{item.name} must be a finite number >= 0, got {value!r}")

    @classmethod
    def from_coefficients(cls, coefficients: Iterable[float]) -> StepCostModel:
        """The model of coefficients given in field order (as `StepCounts.as_tuple`)."""
        return cls(*(float(value) for value in coefficients))

    def coefficients(self) -> tuple[float, ...]:
        return tuple(getattr(self, item.name) for item in fields(self))

    def step_time_s(self, batch: Iterable[tuple[int, int]]) -> float:
        """Seconds of a step over `(num_computed_tokens, num_new_tokens)` per scheduled
        request; an empty step costs nothing."""
        counts = StepCounts.of(batch).as_tuple()
        return math.fsum(c * n for c, n in zip(self.coefficients(), counts, strict=True))


COST_TERMS: tuple[str, ...] = tuple(item.name for item in fields(StepCostModel))
