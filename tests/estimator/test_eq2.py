"""The Eq. 2 estimator: cold start, the per-tool and pooled fallbacks, observations, state."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest

from estimator.base import ToolCall
from estimator.cost_model import PrefillCostModel
from estimator.eq2 import Eq2Estimator
from estimator.history import ToolDurationHistory
from estimator.learned import QuantileBoostingPredictor
from estimator.traces import read_trace_jobs

SLICE = Path(__file__).parents[1] / "data" / "minisweagent_deepseek_slice.jsonl"


def call(job_id: str, tool: str | None, at_s: float = 0.0, tokens: int = 1000,
         turn_index: int = 0) -> ToolCall:
    return ToolCall(job_id, tool, at_s, tokens, turn_index)


def record(estimator: Eq2Estimator, tool: str | None, duration_s: float, job_id: str = "j"
           ) -> None:
    """One observed tool call of `duration_s`, as a policy would report it."""
    estimator.observe_tool_call(call(job_id, tool, 0.0))
    estimator.observe_next_turn(job_id, duration_s)


def estimator_with(k: int = 3, rebuild_s: float = 0.0) -> Eq2Estimator:
    return Eq2Estimator(cold_start_samples=k, prefill_cost=PrefillCostModel(intercept_s=rebuild_s),
                        history=ToolDurationHistory(max_samples=10))


def test_cold_start_uses_the_closed_form_until_more_than_k_samples() -> None:
    estimator = estimator_with(k=3, rebuild_s=1.5)
    estimator.observe_queueing_delay(2.0)
    estimator.observe_queueing_delay(4.0)  # T = 3
    decision = estimator.decide(call("j", "ls"))
    assert decision.basis == "cold-start" and decision.eta == 1.0
    assert decision.benefit_s == 4.5 and decision.ttl_s == pytest.approx(math.log(4.5))
    for _ in range(3):
        record(estimator, "ls", 0.5)
    assert estimator.decide(call("j", "ls")).basis == "cold-start"  # 3 samples: still <= K
    record(estimator, "ls", 0.5)
    decision = estimator.decide(call("j", "ls"))
    assert decision.basis == "tool" and decision.num_samples == 4
    assert decision.ttl_s == 0.5  # P(.5) = 1: 4.5 - .5 beats not pinning


def test_cold_start_does_not_pin_when_the_saving_is_below_one_second() -> None:
    estimator = estimator_with(rebuild_s=0.4)
    estimator.observe_queueing_delay(0.5)
    assert estimator.ttl_s(call("j", "ls")) == 0.0


def test_a_rebuild_costs_every_request_running_beside_it() -> None:
    estimator = estimator_with(rebuild_s=0.4)
    alone = estimator.decide(call("j", "ls"))
    assert alone.rebuild_s == 0.4 and alone.ttl_s == 0.0  # the paper's R: not worth a pin
    busy = estimator.decide(ToolCall("j", "ls", 0.0, 1000, 0, num_running_requests=4))
    assert busy.rebuild_s == pytest.approx(0.4 * 5)  # its prefill stretches 4 others' steps
    assert busy.ttl_s == pytest.approx(math.log(2.0))


def test_tools_with_at_most_k_samples_use_the_pooled_cdf() -> None:
    estimator = estimator_with(k=3, rebuild_s=3.0)
    for duration_s in (0.1, 0.1, 0.1, 0.1):
        record(estimator, "fast", duration_s)
    for duration_s in (2.0, 2.0):
        record(estimator, "slow", duration_s)
    # "slow" has 2 <= K samples: the pool (0.1 x4, 2.0 x2) decides, not its own 2 s samples.
    decision = estimator.decide(call("j", "slow"))
    assert decision.basis == "pooled" and decision.num_samples == 6
    # t=.1: 4/6*3 - .1 = 1.9 beats t=2: 3 - 2 = 1.
    assert decision.ttl_s == 0.1
    assert estimator.decide(call("j", None)).basis == "pooled"  # an unknown tool
    record(estimator, "slow", 2.0)
    record(estimator, "slow", 2.0)
    decision = estimator.decide(call("j", "slow"))
    assert (decision.basis, decision.ttl_s) == ("tool", 2.0)  # its own samples: 3 - 2 = 1


def test_benefit_is_t_times_eta_plus_r_once_warm() -> None:
    estimator = estimator_with(k=0, rebuild_s=1.0)
    estimator.observe_queueing_delay(3.0)
    for num_turns in (2, 4):  # eta = 5/11
        estimator.observe_job_end(f"done-{num_turns}", num_turns)
    record(estimator, "ls", 0.2)
    decision = estimator.decide(call("j", "ls", tokens=10))
    assert decision.eta == pytest.approx(5 / 11)
    assert decision.benefit_s == pytest.approx(3.0 * 5 / 11 + 1.0)
    assert decision.rebuild_s == 1.0 and decision.queueing_delay_s == 3.0
    assert estimator.last_decision == decision


def test_durations_run_from_a_turns_finish_to_the_next_arrival() -> None:
    estimator = estimator_with()
    estimator.observe_tool_call(call("a", "grep", at_s=10.0))
    estimator.observe_next_turn("a", 10.75)
    estimator.observe_next_turn("a", 99.0)  # no pending call: nothing recorded
    estimator.observe_next_turn("b", 1.0)
    assert list(estimator.history.samples("grep")) == [0.75]
    assert estimator.recent_calls.of("a") == (("grep", 0.75),)
    estimator.observe_job_end("a", 2)
    assert estimator.recent_calls.of("a") == () and estimator.turns.num_turns == [2]


def test_state_round_trips_through_a_json_file(tmp_path) -> None:
    estimator = estimator_with(k=2, rebuild_s=0.7)
    for duration_s in (0.1, 0.4, 0.2):
        record(estimator, "cat", duration_s)
    record(estimator, None, 3.0)
    estimator.observe_queueing_delay(1.25)
    estimator.observe_job_end("x", 7)
    path = tmp_path / "state.json"
    estimator.save(path)
    restored = estimator_with(k=2)
    restored.load(path)
    assert restored.state() == estimator.state()
    assert restored.prefill_cost == estimator.prefill_cost
    for tool in ("cat", "other", None):
        assert restored.decide(call("j", tool)) == estimator.decide(call("j", tool))


def test_a_corrupt_state_file_falls_back_to_the_cold_start_with_a_warning(
    tmp_path, caplog
) -> None:
    estimator = estimator_with()
    record(estimator, "cat", 0.3)
    before = estimator.state()
    path = tmp_path / "state.json"
    good = dict(before)
    corrupt = (
        "{", "[" * 100_000, json.dumps({**good, "version": 99}), json.dumps({"version": 1}),
        json.dumps({**good, "pooled_s": [-1.0]}),
        json.dumps({**good, "job_num_turns": [1e400]}),  # Infinity: int() overflows
        json.dumps({**good, "records": [[["t", 1e400, 5, []], 1.0]]}),
        json.dumps({**good, "tools_s": {"t": "not a list"}}),
    )
    for bad in corrupt:
        path.write_text(bad)
        with pytest.raises(ValueError):
            estimator.load(path)
        assert estimator.state() == before  # a failed load changes nothing
        with caplog.at_level(logging.WARNING, logger="estimator.eq2"):
            assert estimator.load_or_cold_start(path) is False
        assert "starting cold" in caplog.text
    assert estimator.load_or_cold_start(tmp_path / "missing.json") is False


def test_warm_start_from_a_trace_learns_durations_and_job_lengths() -> None:
    jobs = read_trace_jobs(SLICE)
    estimator = Eq2Estimator()
    estimator.warm_start(jobs)
    num_calls = sum(len(job.calls) for job in jobs)
    assert len(estimator.history.samples(None)) == num_calls == len(estimator.records)
    assert estimator.turns.num_turns == [job.num_turns for job in jobs]
    assert estimator.decide(call("new", "cat")).basis in ("tool", "pooled")


def test_a_learned_estimator_decides_from_its_predictor_and_survives_a_reload(tmp_path) -> None:
    estimator = Eq2Estimator(prefill_cost=PrefillCostModel(intercept_s=2.0),
                             predictor=QuantileBoostingPredictor(max_iter=20))
    estimator.warm_start(read_trace_jobs(SLICE))
    assert estimator.predictor.is_fitted
    decision = estimator.decide(call("new", "cat", turn_index=3))
    assert decision.basis == "learned" and decision.ttl_s > 0
    path = tmp_path / "learned.json"
    estimator.save(path)
    restored = Eq2Estimator(predictor=QuantileBoostingPredictor(max_iter=20))
    restored.load(path)  # the training records are saved; the predictor is refitted
    assert restored.decide(call("new", "cat", turn_index=3)) == decision


@pytest.mark.parametrize("background", [False, True])
def test_a_learned_estimator_retrains_after_enough_new_calls(background) -> None:
    predictor = QuantileBoostingPredictor(max_iter=10, min_records=20)
    estimator = Eq2Estimator(cold_start_samples=0, predictor=predictor, refit_every=25,
                             refit_in_background=background)
    for index in range(24):
        record(estimator, "cat" if index % 2 else "grep", 0.1 + index / 100, job_id=f"j{index}")
    assert not estimator.predictor.is_fitted
    assert estimator.decide(call("j", "cat")).basis == "tool"
    record(estimator, "cat", 0.2, job_id="j24")
    estimator.wait_for_refit(timeout_s=60)
    assert estimator.predictor.is_fitted and estimator.predictor is not predictor
    assert estimator.decide(call("j", "cat")).basis == "learned"
