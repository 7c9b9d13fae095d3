"""The linear step-cost model: what it counts in a batch, and what it charges."""

from __future__ import annotations

import pytest

from engine.executor.step_cost import COST_TERMS, StepCostModel, StepCounts


def test_counts_split_prefill_from_decode_queries() -> None:
    # A fresh prefill of 4, a chunk of 3 over 5 cached tokens, two decodes.
    counts = StepCounts.of([(0, 4), (5, 3), (10, 1), (20, 1)])
    assert counts == StepCounts(num_steps=1, num_prefill_tokens=7, num_prefill_queries=2,
                                num_decode_queries=2, num_context_tokens=4 + 8 + 11 + 21,
                                num_attention_pairs=4 * 5 // 2 + (3 * 5 + 3 * 4 // 2))
    assert StepCounts.of([]) == StepCounts.of([(7, 0)]) == StepCounts(0, 0, 0, 0, 0, 0)


def test_a_step_costs_each_coefficient_times_its_count() -> None:
    model = StepCostModel(step_overhead_s=0.03, prefill_token_s=2e-5, prefill_query_s=0.06,
                          decode_query_s=1e-3, context_token_s=1e-7, attention_pair_s=5e-9)
    batch = [(0, 4), (5, 3), (10, 1), (20, 1)]
    counts = StepCounts.of(batch).as_tuple()
    assert model.step_time_s(batch) == pytest.approx(
        sum(c * n for c, n in zip(model.coefficients(), counts, strict=True)))
    assert model.step_time_s([]) == 0.0
    assert StepCostModel.from_coefficients(model.coefficients()) == model
    assert len(COST_TERMS) == len(counts)


@pytest.mark.parametrize("value", [-1e-9, float("inf"), float("nan"), "0.1"])
def test_a_coefficient_must_be_a_finite_number_at_least_zero(value: object) -> None:
    with pytest.raises(ValueError, match="decode_query_s must be a finite number >= 0"):
        StepCostModel(0.0, 0.0, 0.0, value, 0.0, 0.0)  # type: ignore[arg-type]
