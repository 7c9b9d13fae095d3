"""Estimator building blocks: decisions, input bounds, constant TTLs, the fixed release rule,
duration history."""

from __future__ import annotations

import math

import pytest

from estimator.fixed import FixedTTLEstimator
from estimator.history import ToolDurationHistory
from estimator.traces import TraceJob, TraceToolCall
from estimator.ttl_estimator import (
    MAX_OBSERVED_S,
    ConstantTTLEstimator,
    ToolCall,
    TTLDecision,
    clamp_count,
    clamp_seconds,
)


def call(job_id: str, tool: str | None, finished_at_s: float) -> ToolCall:
    return ToolCall(job_id=job_id, tool_name=tool, finished_at_s=finished_at_s,
                    num_context_tokens=100, turn_index=0)


@pytest.mark.parametrize("ttl_s", [-1.0, math.inf, math.nan])
def test_constant_ttl_rejects_bad_values(ttl_s: float) -> None:
    with pytest.raises(ValueError, match="ttl_s"):
        ConstantTTLEstimator(ttl_s)


def test_constant_ttl() -> None:
    estimator = ConstantTTLEstimator(3.5)
    assert estimator.decide(call("j", "ls", 0.0)) == TTLDecision(3.5, "constant")
    assert estimator.state() is None
    with pytest.raises(ValueError, match="keeps no state"):
        estimator.load_state({})


@pytest.mark.parametrize("ttl_s", [-0.5, math.inf, math.nan])
def test_a_decision_is_finite_and_not_negative(ttl_s: float) -> None:
    with pytest.raises(ValueError, match="ttl_s"):
        TTLDecision(ttl_s, "constant")


@pytest.mark.parametrize("value, expected", [
    (1.5, 1.5), (-3.0, 0.0), (1e308, MAX_OBSERVED_S), (math.inf, MAX_OBSERVED_S),
    (-math.inf, 0.0), (10**400, MAX_OBSERVED_S), (math.nan, None),
])
def test_observed_seconds_are_clamped(value, expected) -> None:
    assert clamp_seconds(value) == expected


def test_counts_are_clamped() -> None:
    assert [clamp_count(n, 10) for n in (-1, 0, 7, 11, 10**400)] == [0, 0, 7, 10, 10]
    assert clamp_count(math.nan, 10) == 0 and clamp_count(math.inf, 10) == 10


def test_history_measures_from_finish_to_next_arrival() -> None:
    history = ToolDurationHistory()
    history.start(call("a", "ls", 1.0))
    history.start(call("b", None, 2.0))
    assert history.finish("a", 1.25) == 0.25
    assert history.finish("b", 5.0) == 3.0
    assert history.finish("b", 9.0) is None  # no pending call
    assert list(history.samples("ls")) == [0.25] and list(history.samples(None)) == [0.25, 3.0]
    assert history.mean_s("ls") == 0.25 and history.mean_s("cat") is None


def test_history_clamps_hostile_durations() -> None:
    history = ToolDurationHistory()
    history.start(call("a", "ls", -1e308))
    assert history.finish("a", 1e308) == MAX_OBSERVED_S  # the difference overflows to inf
    history.start(call("b", "ls", math.inf))
    assert history.finish("b", math.inf) is None  # inf - inf is NaN: nothing recorded
    history.add("ls", 1.7e308)
    history.add("ls", math.nan)
    history.add_to_tool("cat", -5.0)
    history.extend_pooled([1e300, math.nan])
    assert list(history.samples("ls")) == [MAX_OBSERVED_S] * 2
    assert list(history.samples("cat")) == [0.0]
    assert list(history.samples(None)) == [MAX_OBSERVED_S] * 3
    assert history.mean_s(None) == MAX_OBSERVED_S


def test_history_is_bounded() -> None:
    history = ToolDurationHistory(max_samples=3, max_tools=2, max_pending=2)
    for index in range(5):
        history.add("ls", float(index))
    history.add("cat", 1.0)
    history.add("grep", 1.0)  # forgets "ls", the least recently sampled tool
    assert history.samples("ls") == () and list(history.samples(None)) == [4.0, 1.0, 1.0]
    for job in "abc":
        history.start(call(job, "ls", 0.0))
    assert history.num_pending == 2 and history.finish("a", 1.0) is None
    history.forget_job("b")
    assert history.num_pending == 1


def test_fixed_rule_pins_two_seconds_for_fast_or_unknown_tools() -> None:
    estimator = FixedTTLEstimator()
    assert estimator.decide(call("j", "ls", 0.0)) == TTLDecision(2.0, "fixed", num_samples=0)
    for arrival_s, tool in [(1.0, "ls"), (3.5, "build")]:
        estimator.observe_tool_call(call("j", tool, 0.0))
        estimator.observe_next_turn("j", arrival_s)
    assert estimator.decide(call("j", "ls", 0.0)) == TTLDecision(2.0, "fixed", num_samples=1)
    assert estimator.decide(call("j", "build", 0.0)).ttl_s == 0.0
    assert estimator.decide(call("j", None, 0.0)).ttl_s == 2.0  # the pool is not consulted
    assert estimator.state() is None


@pytest.mark.parametrize("ttl_s", [0.0, -1.0, math.inf, math.nan])
def test_fixed_rule_rejects_bad_ttls(ttl_s: float) -> None:
    with pytest.raises(ValueError, match="ttl_s"):
        FixedTTLEstimator(ttl_s)


def test_fixed_rule_warm_starts_and_survives_hostile_observations() -> None:
    estimator = FixedTTLEstimator()
    estimator.warm_start([TraceJob("w", 0.0, (TraceToolCall("build", 9.0, 10, 1.0),), 2)])
    assert estimator.decide(call("j", "build", 0.0)).ttl_s == 0.0
    for index, arrival_s in enumerate((1.7e308, math.nan, math.inf)):
        estimator.observe_tool_call(call(f"h{index}", "ls", 0.0))
        estimator.observe_next_turn(f"h{index}", arrival_s)
    estimator.observe_queueing_delay(1e308)
    estimator.observe_job_end("h0", 10**400)
    assert estimator.decide(call("j", "ls", 0.0)).ttl_s == 0.0  # mean: a day
