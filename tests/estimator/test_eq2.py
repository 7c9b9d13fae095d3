"""The Eq. 2 estimator: cold start, the per-tool and pooled fallbacks, observations, state."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest

from estimator.cost_model import PrefillCostModel
from estimator.eq2 import DEFAULT_MAX_TTL_S, Eq2Estimator
from estimator.history import ToolDurationHistory
from estimator.learned import QuantileBoostingPredictor
from estimator.state_file import load_state_or_cold_start, read_state, save_state
from estimator.traces import read_trace_jobs
from estimator.ttl_estimator import MAX_OBSERVED_S, ToolCall

SLICE = Path(__file__).parents[1] / "data" / "minisweagent_deepseek_slice.jsonl"


def call(job_id: str, tool: str | None, at_s: float = 0.0, tokens: int = 1000,
         turn_index: int = 0) -> ToolCall:
    return ToolCall(job_id, tool, at_s, tokens, turn_index)


def record(estimator: Eq2Estimator, tool: str | None, duration_s: float, job_id: str = "j"
           ) -> None:
    """One observed tool call of `duration_s`, as a policy would report it."""
    estimator.observe_tool_call(call(job_id, tool, 0.0))
    estimator.observe_next_turn(job_id, duration_s)


def estimator_with(k: int = 3, rebuild_s: float = 0.0, **settings) -> Eq2Estimator:
    """The paper's Eq. 2 (R its prefill time, a pin charged its TTL), whose cold start and
    per-tool CDFs both need more than `k` samples (the paper's one K), unless `settings`
    say otherwise."""
    settings = {"cold_start_samples": k, "min_tool_samples": k, "rebuild_cost": "prefill",
                "pin_cost": "ttl", **settings}
    return Eq2Estimator(prefill_cost=PrefillCostModel(intercept_s=rebuild_s),
                        history=ToolDurationHistory(max_samples=10), **settings)


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


def test_without_a_cold_start_the_first_observed_duration_decides() -> None:
    estimator = estimator_with(k=3, rebuild_s=1.5, cold_start_samples=0)
    for job_id, num_turns in (("a", 2), ("b", 6)):  # jobs of unequal length: eta < 1
        estimator.observe_job_end(job_id, num_turns)
    assert estimator.decide(call("j", "ls")).eta == 1.0  # nothing observed yet: cold start
    record(estimator, "ls", 0.5)
    decision = estimator.decide(call("j", "ls"))
    # The pooled CDF until the tool has more than min_tool_samples of its own.
    assert (decision.basis, decision.num_samples, decision.ttl_s) == ("pooled", 1, 0.5)
    assert decision.eta == estimator.turns.eta < 1.0
    for _ in range(3):
        record(estimator, "ls", 0.25)
    assert estimator.decide(call("j", "ls")).basis == "tool"


def test_the_cold_start_and_the_per_tool_threshold_are_checked_on_construction() -> None:
    valid = {"cold_start_samples": 9, "min_tool_samples": 9}
    for name in valid:
        for value in (10, -1):  # the history keeps 10 durations: more could never be seen
            with pytest.raises(ValueError, match=name):
                Eq2Estimator(history=ToolDurationHistory(max_samples=10),
                             **{**valid, name: value})


def test_cold_start_does_not_pin_when_the_saving_is_below_one_second() -> None:
    estimator = estimator_with(rebuild_s=0.4)
    estimator.observe_queueing_delay(0.5)
    assert estimator.decide(call("j", "ls")).ttl_s == 0.0


def test_the_papers_rebuild_cost_is_the_prefill_time_alone() -> None:
    estimator = estimator_with(rebuild_s=0.4)
    assert estimator.rebuild_cost == "prefill"
    for running in (0, 4):
        decision = estimator.decide(ToolCall("j", "ls", 0.0, 1000, 0, running))
        assert decision.rebuild_s == 0.4 and decision.ttl_s == 0.0  # not worth a pin


def test_the_defaults_are_those_continuum_runs() -> None:
    estimator = Eq2Estimator()
    assert (estimator.rebuild_cost, estimator.pin_cost, estimator.cold_start_samples) == (
        "prefill-times-running", "priced-capped", 0)


def test_the_stalled_rebuild_cost_counts_every_request_running_beside_it() -> None:
    estimator = estimator_with(rebuild_s=0.4, rebuild_cost="prefill-times-running")
    alone = estimator.decide(call("j", "ls"))
    assert alone.rebuild_s == 0.4 and alone.ttl_s == 0.0  # alone: the paper's R
    busy = estimator.decide(ToolCall("j", "ls", 0.0, 1000, 0, num_running_requests=4))
    assert busy.rebuild_s == pytest.approx(0.4 * 5)  # its prefill stretches 4 others' steps
    assert busy.ttl_s == pytest.approx(math.log(2.0))
    crowded = estimator.decide(ToolCall("j", "ls", 0.0, 1000, 0, num_running_requests=10**400))
    assert math.isfinite(crowded.rebuild_s) and crowded.ttl_s <= DEFAULT_MAX_TTL_S


@pytest.mark.parametrize("settings", [
    {"rebuild_cost": "prefill-squared"}, {"max_ttl_s": 0.0}, {"max_ttl_s": math.inf},
    {"max_ttl_s": math.nan},
])
def test_bad_settings_are_rejected(settings) -> None:
    with pytest.raises(ValueError):
        Eq2Estimator(**settings)


def test_every_ttl_is_capped() -> None:
    cold = estimator_with(rebuild_s=1e6, max_ttl_s=5.0)
    assert cold.decide(call("j", "ls")).ttl_s == 5.0  # ln(1e6) = 13.8 s, capped
    assert estimator_with(rebuild_s=1e6).decide(call("j", "ls")).ttl_s == pytest.approx(
        math.log(1e6))
    warm = estimator_with(k=0, rebuild_s=1e6, max_ttl_s=5.0)
    record(warm, "build", 50.0)
    decision = warm.decide(call("j", "build"))
    assert decision.basis == "tool" and decision.ttl_s == 5.0


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
    assert save_state(estimator, path) is True
    restored = Eq2Estimator(cold_start_samples=2, min_tool_samples=2, rebuild_cost="prefill",
                            pin_cost="ttl", history=ToolDurationHistory(max_samples=10))
    assert load_state_or_cold_start(restored, path) is True
    assert restored.state() == estimator.state()
    assert restored.prefill_cost == estimator.prefill_cost  # it had none: the state's
    for tool in ("cat", "other", None):
        assert restored.decide(call("j", tool)) == estimator.decide(call("j", tool))


def test_a_loaded_state_keeps_the_estimators_own_settings_and_prefill_cost() -> None:
    saved = estimator_with(rebuild_s=0.7)
    record(saved, "cat", 0.3)
    mine = PrefillCostModel(intercept_s=2.0)
    estimator = Eq2Estimator(prefill_cost=mine, rebuild_cost="prefill-times-running",
                             max_ttl_s=1.0)
    estimator.load_state(saved.state())
    assert estimator.prefill_cost is mine  # a measured or given profile wins
    assert (estimator.rebuild_cost, estimator.max_ttl_s) == ("prefill-times-running", 1.0)
    assert estimator.decide(ToolCall("j", "cat", 0.0, 10, 0, 3)).rebuild_s == 8.0


def test_only_the_latest_entries_of_a_larger_state_are_read() -> None:
    state = estimator_with().state()
    state = {**state, "pooled_s": [float(n) for n in range(25)],
             "tools_s": {f"t{n}": [1.0] * 12 for n in range(5)},
             "queueing_delays_s": [9.0] * 3 + [1.0] * 4}
    estimator = Eq2Estimator(history=ToolDurationHistory(max_samples=10, max_tools=3),
                             cold_start_samples=3, min_tool_samples=3, queueing_window=4)
    estimator.load_state(state)
    assert list(estimator.history.samples(None)) == [float(n) for n in range(15, 25)]
    assert estimator.history.tool_names == ["t2", "t3", "t4"]
    assert len(estimator.history.samples("t4")) == 10
    assert estimator.queueing_delay.mean == 1.0


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
        json.dumps({**good, "tools_s": ["not", "an", "object"]}),
        json.dumps({**good, "queueing_delays_s": 3.0}),
    )
    for bad in corrupt:
        path.write_text(bad)
        with pytest.raises(ValueError):
            estimator.load_state(read_state(path))
        assert estimator.state() == before  # a failed load changes nothing
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="estimator.state_file"):
            assert load_state_or_cold_start(estimator, path) is False
        assert "starting cold" in caplog.text
        assert estimator.state() == before
    assert load_state_or_cold_start(estimator, tmp_path / "missing.json") is False


def _state_with(**changes) -> dict:
    estimator = estimator_with()
    for duration_s in (0.1, 0.2, 0.3, 0.4):
        record(estimator, "cat", duration_s)
    estimator.observe_job_end("j", 5)
    return {**estimator.state(), **changes}


# Finite values whose sums overflow, or which make the mean, eta or R absurd.
HOSTILE_STATES = {
    "pooled sum overflows": {"pooled_s": [1.7e308, 1.7e308]},
    "tool sum overflows": {"tools_s": {"cat": [1.7e308, 1.7e308]}},
    "queueing delays overflow": {"queueing_delays_s": [1e308, 1e308]},
    "a duration beyond a day": {"pooled_s": [MAX_OBSERVED_S * 2]},
    "record durations overflow": {"records": [[["cat", 0, 5, []], 1.7e308]] * 2},
    "recent durations overflow": {"records": [[["cat", 0, 5, [["cat", 1e308]]], 1.0]]},
    "a huge turn index": {"records": [[["cat", 10**300, 5, []], 1.0]]},
    "a huge context": {"records": [[["cat", 0, 10**300, []], 1.0]]},
    "a job too long for eta": {"job_num_turns": [10**200, 10**200, 2]},
    "R infinite": {"prefill_cost": {"intercept_s": 0, "linear_s": 1e308, "quadratic_s": 1e308}},
    "R absurd": {"prefill_cost": {"intercept_s": 0, "linear_s": 0, "quadratic_s": 1e6}},
    "an integer beyond floats": {"pooled_s": [10**400]},
}


@pytest.mark.parametrize("changes", HOSTILE_STATES.values(), ids=HOSTILE_STATES.keys())
def test_a_state_whose_derived_values_are_not_sound_is_refused(changes, tmp_path, caplog
                                                               ) -> None:
    estimator = Eq2Estimator()
    with pytest.raises(ValueError, match="not an estimator state"):
        estimator.load_state(_state_with(**changes))
    assert estimator.state() == Eq2Estimator().state()  # nothing changed
    path = tmp_path / "state.json"
    path.write_text(json.dumps(_state_with(**changes)))
    with caplog.at_level(logging.WARNING, logger="estimator.state_file"):
        assert load_state_or_cold_start(estimator, path) is False
    assert "starting cold" in caplog.text
    decision = estimator.decide(call("j", "cat", tokens=10_000_000))
    assert decision.basis == "cold-start" and 0 <= decision.ttl_s <= DEFAULT_MAX_TTL_S


def test_hostile_observations_cannot_make_a_decision_raise_or_pin_forever() -> None:
    estimator = Eq2Estimator(cold_start_samples=2,
                             prefill_cost=PrefillCostModel(0.0, 1.0, 1.0),
                             predictor=QuantileBoostingPredictor(max_iter=5, min_records=3),
                             refit_every=3, refit_in_background=False)
    for delay_s in (1e308, 1e308, math.inf, math.nan, -1e308):
        estimator.observe_queueing_delay(delay_s)
    assert estimator.queueing_delay.mean == pytest.approx(0.75 * MAX_OBSERVED_S)  # NaN: no
    arrivals = (1.7e308, 1.7e308, math.inf, math.nan, -1e308, 1e-300)
    for index, arrived_at_s in enumerate(arrivals):
        job_id = f"h{index}"
        estimator.observe_tool_call(ToolCall(job_id, "cat", -1.7e308, 10**400, 10**400,
                                             10**400))
        estimator.observe_next_turn(job_id, arrived_at_s)
        estimator.observe_job_end(job_id, 10**400)
    estimator.observe_job_end("short", -5)
    assert max(estimator.history.samples(None)) == MAX_OBSERVED_S
    assert estimator.predictor.is_fitted  # refitted on the clamped records
    for tokens in (0, 10**400):
        for running in (0, 10**400):
            decision = estimator.decide(ToolCall("j", "cat", 0.0, tokens, 10**400, running))
            assert math.isfinite(decision.ttl_s) and 0 <= decision.ttl_s <= DEFAULT_MAX_TTL_S
    reloaded = Eq2Estimator(predictor=QuantileBoostingPredictor(max_iter=5, min_records=3))
    reloaded.load_state(json.loads(json.dumps(estimator.state())))  # what it saves loads
    assert reloaded.decide(call("j", "cat")).ttl_s <= DEFAULT_MAX_TTL_S
    estimator.prefill_cost = PrefillCostModel(0.0, 1e300, 1e300)  # R = inf: still capped
    decision = estimator.decide(call("j", "cat", tokens=10**400))
    assert decision.rebuild_s == math.inf and decision.ttl_s <= DEFAULT_MAX_TTL_S


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
    save_state(estimator, path)
    restored = Eq2Estimator(predictor=QuantileBoostingPredictor(max_iter=20))
    restored.load_state(read_state(path))  # the training records are saved; it is refitted
    assert restored.decide(call("new", "cat", turn_index=3)) == decision


@pytest.mark.parametrize("background", [False, True])
def test_a_learned_estimator_retrains_after_enough_new_calls(background) -> None:
    predictor = QuantileBoostingPredictor(max_iter=10, min_records=20)
    estimator = Eq2Estimator(cold_start_samples=0, min_tool_samples=0, predictor=predictor,
                             refit_every=25, refit_in_background=background)
    for index in range(24):
        record(estimator, "cat" if index % 2 else "grep", 0.1 + index / 100, job_id=f"j{index}")
    assert not estimator.predictor.is_fitted
    assert estimator.decide(call("j", "cat")).basis == "tool"
    record(estimator, "cat", 0.2, job_id="j24")
    estimator.wait_for_refit(timeout_s=60)
    assert estimator.predictor.is_fitted and estimator.predictor is not predictor
    assert estimator.decide(call("j", "cat")).basis == "learned"


@pytest.mark.parametrize(("pin_cost", "expected_ttl_s"), [("priced", 0.0),
                                                           ("priced-capped", 1.0)])
def test_a_capped_price_counts_no_more_requests_than_the_pool_holds(pin_cost, expected_ttl_s
                                                                     ) -> None:
    estimator = estimator_with(k=0, rebuild_s=2.0, pin_cost=pin_cost)
    for _ in range(3):
        record(estimator, "ls", 1.0)
    # A fifth of a small pool that holds 5 requests of the running ones' size, 24 active:
    # priced at 0.2 x 24 = 4.8 s a second it outweighs the 2 s rebuild; capped, 0.2 x 5 = 1.
    small_pool = ToolCall("j", "ls", 0.0, 1000, 0, num_running_requests=4,
                          num_waiting_requests=20, pool_share=0.2, running_pool_share=0.8)
    assert estimator.memory_price(small_pool) == pytest.approx(
        {"priced": 4.8, "priced-capped": 1.0}[pin_cost])
    decision = estimator.decide(small_pool)
    assert decision.ttl_s == expected_ttl_s
    assert decision.memory_price == estimator.memory_price(small_pool)  # for the trace
    # With nothing else running there is no mean size: the waiting requests price it in full.
    alone = ToolCall("j", "ls", 0.0, 1000, 0, num_waiting_requests=20, pool_share=0.2)
    assert estimator.memory_price(alone) == pytest.approx(4.0)
    # Shares that say nothing never make a pin free.
    for share in (math.nan, math.inf, 1e-320, 5.0):
        odd = ToolCall("j", "ls", 0.0, 1000, 0, num_running_requests=4, num_waiting_requests=20,
                       pool_share=0.2, running_pool_share=share)
        assert estimator.memory_price(odd) >= 0.2 * 4
        assert math.isfinite(estimator.decide(odd).ttl_s)
    # While no request waits, every request runs: a capped pin is free, a priced one is not.
    idle = ToolCall("j", "ls", 0.0, 1000, 0, num_running_requests=4, pool_share=0.2,
                    running_pool_share=0.8)
    assert estimator.memory_price(idle) == pytest.approx(
        {"priced": 0.2 * 4, "priced-capped": 0.0}[pin_cost])
    # Unpriced pin costs, and the cold start, report no price.
    unpriced = estimator_with(k=0, rebuild_s=2.0, pin_cost="expected-hold")
    record(unpriced, "ls", 1.0)
    assert unpriced.decide(small_pool).basis == "tool"
    assert unpriced.decide(small_pool).memory_price is None
    assert estimator_with(k=3, pin_cost=pin_cost).decide(small_pool).memory_price is None
