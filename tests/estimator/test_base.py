"""Estimator building blocks: constant TTLs, the fixed release rule, duration history."""

from __future__ import annotations

import math

import pytest

from estimator.base import ConstantTTLEstimator, ToolCall
from estimator.fixed import FixedTTLEstimator
from estimator.history import ToolDurationHistory


def call(job_id: str, tool: str | None, finished_at_s: float) -> ToolCall:
    return ToolCall(job_id=job_id, tool_name=tool, finished_at_s=finished_at_s,
                    num_context_tokens=100, turn_index=0)


@pytest.mark.parametrize("ttl_s", [-1.0, math.inf, math.nan])
def test_constant_ttl_rejects_bad_values(ttl_s: float) -> None:
    with pytest.raises(ValueError, match="ttl_s"):
        ConstantTTLEstimator(ttl_s)


def test_constant_ttl() -> None:
    assert ConstantTTLEstimator(3.5).ttl_s(call("j", "ls", 0.0)) == 3.5


def test_history_measures_from_finish_to_next_arrival() -> None:
    history = ToolDurationHistory()
    history.start(call("a", "ls", 1.0))
    history.start(call("b", None, 2.0))
    assert history.finish("a", 1.25) == 0.25
    assert history.finish("b", 5.0) == 3.0
    assert history.finish("b", 9.0) is None  # no pending call
    assert list(history.samples("ls")) == [0.25] and list(history.samples(None)) == [0.25, 3.0]
    assert history.mean_s("ls") == 0.25 and history.mean_s("cat") is None


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
    assert estimator.ttl_s(call("j", "ls", 0.0)) == 2.0
    for arrival_s, tool in [(1.0, "ls"), (3.5, "build")]:
        estimator.observe_tool_call(call("j", tool, 0.0))
        estimator.observe_next_turn("j", arrival_s)
    assert estimator.ttl_s(call("j", "ls", 0.0)) == 2.0
    assert estimator.ttl_s(call("j", "build", 0.0)) == 0.0
    assert estimator.ttl_s(call("j", None, 0.0)) == 2.0  # the pool is not consulted
    with pytest.raises(ValueError):
        FixedTTLEstimator(0.0)
