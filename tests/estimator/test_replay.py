"""Tool calls replayed through TTL estimators: the two scorings, learning `T` from misses, the
oracle and the split by arrival (the command: `tests/eval/bench/test_estimator.py`)."""

from __future__ import annotations

import math

import pytest

from estimator.cost_model import PrefillCostModel
from estimator.eq2 import Eq2Estimator
from estimator.replay import Scorer, oracle, replay, split_by_arrival
from estimator.traces import TraceJob, TraceToolCall
from estimator.ttl_estimator import ConstantTTLEstimator


def job(job_id: str, arrival_s: float, *durations_s: float) -> TraceJob:
    calls = tuple(TraceToolCall("t", d, 1000, 1.0) for d in durations_s)
    return TraceJob(job_id, arrival_s, calls, len(calls) + 1)


# A hit saves B = T * eta + R = 1 + 2 = 3 s.
SCORER = Scorer(queueing_delay_s=1.0, eta=1.0, prefill_cost=PrefillCostModel(intercept_s=2.0))


def test_a_used_pin_costs_the_time_until_its_next_turn_and_an_expired_one_its_ttl() -> None:
    # A 2 s TTL: the 0.5 s call hits (saves 3, holds 0.5 s; the old scoring charged 2 s), the
    # 4 s call misses (wastes the whole 2 s).
    report = replay([job("a", 0.0, 0.5, 4.0)], ConstantTTLEstimator(2.0), SCORER).report()
    assert report["num_calls"] == 2 and report["pin_rate"] == 1.0
    assert report["hit_rate"] == 0.5 and report["reuse_rate"] == 0.5
    assert report["wasted_pin_s"] == 2.0 and report["mean_ttl_s"] == 2.0
    assert report["mean_held_s"] == pytest.approx((0.5 + 2.0) / 2)
    assert report["mean_utility"] == pytest.approx(((3.0 - 0.5) + (0 - 2.0)) / 2)
    assert report["mean_utility_ttl_cost"] == pytest.approx(((3.0 - 2.0) + (0 - 2.0)) / 2)
    assert report["mean_T_s"] is None  # a constant TTL uses no queueing delay
    unpinned = replay([job("a", 0.0, 1.0)], ConstantTTLEstimator(0.0), SCORER).report()
    assert unpinned["pin_rate"] == 0.0 and unpinned["mean_utility"] == 0.0


class Log(ConstantTTLEstimator):
    def __init__(self, ttl_s: float = 1.0) -> None:
        super().__init__(ttl_s)
        self.events: list[tuple] = []

    def observe_tool_call(self, call) -> None:
        self.events.append(("call", call.job_id, call.finished_at_s))

    def observe_next_turn(self, job_id, arrived_at_s) -> None:
        self.events.append(("next", job_id, arrived_at_s))

    def observe_queueing_delay(self, delay_s) -> None:
        self.events.append(("delay", delay_s))

    def observe_job_end(self, job_id, num_turns) -> None:
        self.events.append(("end", job_id, num_turns))


def test_no_decision_sees_a_duration_before_it_ends() -> None:
    # Job a's tool runs from 1 s to 11 s (past its 1 s pin: a miss, which reports T); job b
    # decides at 3 s, before a's tool ends, and hits.
    log = Log()
    replay([job("a", 0.0, 10.0), job("b", 2.0, 0.5)], log, SCORER)
    assert log.events == [
        ("call", "a", 1.0), ("call", "b", 3.0), ("next", "b", 3.5), ("end", "b", 2),
        ("next", "a", 11.0), ("delay", 1.0), ("end", "a", 2),
    ]


@pytest.mark.parametrize("ttl_s, expected_delays", [(2.0, 1), (0.0, 3), (9.0, 0)])
def test_t_is_learned_only_from_turns_that_missed_their_pin(ttl_s, expected_delays) -> None:
    # Durations 0.5, 4 and 1: a 2 s pin misses once, no pin misses every time.
    log = Log(ttl_s)
    replay([job("a", 0.0, 0.5, 4.0, 1.0)], log, SCORER)
    assert [event for event in log.events if event[0] == "delay"] == [
        ("delay", 1.0)] * expected_delays
    handed = Log(ttl_s)
    replay([job("a", 0.0, 0.5, 4.0, 1.0)], handed, SCORER, learn_queueing_delay=False)
    assert handed.events[0] == ("delay", 1.0)  # handed once, before the replay
    assert [event for event in handed.events if event[0] == "delay"] == [("delay", 1.0)]


def test_an_eq2_estimator_learns_t_from_its_first_miss() -> None:
    # R = 0 and T = 3: knowing no delay, the cold start does not pin the first call (a miss,
    # which teaches T = 3), then pins ln 3 = 1.0986 s for the next two, which hit.
    scorer = Scorer(queueing_delay_s=3.0, eta=1.0, prefill_cost=PrefillCostModel())
    jobs = [job("a", 0.0, 0.5, 0.5, 0.5)]
    def papers() -> Eq2Estimator:
        return Eq2Estimator(rebuild_cost="prefill", pin_cost="ttl", cold_start_samples=100)

    learned = replay(jobs, papers(), scorer).report()
    assert (learned["pin_rate"], learned["hit_rate"]) == (pytest.approx(2 / 3), 1.0)
    assert learned["mean_T_s"] == pytest.approx((0 + 3 + 3) / 3)
    assert learned["mean_utility"] == pytest.approx((0 + 2.5 + 2.5) / 3)
    handed = replay(jobs, papers(), scorer, learn_queueing_delay=False).report()
    assert (handed["pin_rate"], handed["mean_T_s"]) == (1.0, 3.0)
    assert handed["mean_utility"] == pytest.approx(2.5)
    assert handed["mean_utility_ttl_cost"] == pytest.approx(3.0 - math.log(3.0))


def test_the_oracle_pins_exactly_the_calls_worth_it() -> None:
    report = oracle([job("a", 0.0, 1.0, 4.0)], SCORER).report()  # 4 s > the 3 s saving
    assert (report["pin_rate"], report["hit_rate"], report["wasted_pin_s"]) == (0.5, 1.0, 0.0)
    assert report["mean_utility"] == pytest.approx((3.0 - 1.0) / 2)
    assert report["mean_utility_ttl_cost"] == report["mean_utility"]  # its TTL is the duration


def test_the_split_is_by_arrival_time() -> None:
    jobs = [job("late", 9.0, 1.0), job("early", 1.0, 1.0), job("mid", 5.0, 1.0)]
    train, test = split_by_arrival(jobs, 0.67)
    assert [j.job_id for j in train] == ["early", "mid"] and [j.job_id for j in test] == ["late"]
    with pytest.raises(ValueError):
        split_by_arrival(jobs, 1.0)
