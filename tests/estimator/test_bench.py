"""`continuum bench estimator`: the replay's scoring and the command's JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.cli import main
from estimator.base import ConstantTTLEstimator
from estimator.bench import Scorer, oracle, replay, split_by_arrival
from estimator.cost_model import PrefillCostModel
from estimator.traces import TraceJob, TraceToolCall

SLICE = Path(__file__).parents[1] / "data" / "minisweagent_deepseek_slice.jsonl"
KEYS = {"pin_rate", "hit_rate", "wasted_pin_s", "mean_ttl_s", "mean_utility"}


def job(job_id: str, arrival_s: float, *durations_s: float) -> TraceJob:
    calls = tuple(TraceToolCall("t", d, 1000, 1.0) for d in durations_s)
    return TraceJob(job_id, arrival_s, calls, len(calls) + 1)


SCORER = Scorer(queueing_delay_s=1.0, eta=1.0, prefill_cost=PrefillCostModel(intercept_s=2.0))


def test_replay_scores_hits_waste_and_eq2_utility() -> None:
    # A 1.5 s TTL: the 1 s call hits (saves T + R = 3, minus 1.5), the 4 s call misses
    # (wastes the whole 1.5 s).
    report = replay([job("a", 0.0, 1.0, 4.0)], ConstantTTLEstimator(1.5), SCORER).report()
    assert report["num_calls"] == 2 and report["pin_rate"] == 1.0
    assert report["hit_rate"] == 0.5 and report["reuse_rate"] == 0.5
    assert report["wasted_pin_s"] == 1.5 and report["mean_ttl_s"] == 1.5
    assert report["mean_utility"] == pytest.approx(((3.0 - 1.5) + (0 - 1.5)) / 2)
    unpinned = replay([job("a", 0.0, 1.0)], ConstantTTLEstimator(0.0), SCORER).report()
    assert unpinned["pin_rate"] == 0.0 and unpinned["mean_utility"] == 0.0


class Log(ConstantTTLEstimator):
    def __init__(self) -> None:
        super().__init__(1.0)
        self.events: list[tuple] = []

    def observe_tool_call(self, call) -> None:
        self.events.append(("call", call.job_id, call.finished_at_s))

    def observe_next_turn(self, job_id, arrived_at_s) -> None:
        self.events.append(("next", job_id, arrived_at_s))

    def observe_job_end(self, job_id, num_turns) -> None:
        self.events.append(("end", job_id, num_turns))


def test_no_decision_sees_a_duration_before_it_ends() -> None:
    # Job a's tool runs from 1 s to 11 s; job b decides at 3 s, before a's tool ends.
    log = Log()
    replay([job("a", 0.0, 10.0), job("b", 2.0, 0.5)], log, SCORER)
    assert log.events == [
        ("call", "a", 1.0), ("call", "b", 3.0), ("next", "b", 3.5), ("end", "b", 2),
        ("next", "a", 11.0), ("end", "a", 2),
    ]


def test_the_oracle_pins_exactly_the_calls_worth_it() -> None:
    report = oracle([job("a", 0.0, 1.0, 4.0)], SCORER).report()  # 4 s > the 3 s saving
    assert (report["pin_rate"], report["hit_rate"], report["wasted_pin_s"]) == (0.5, 1.0, 0.0)
    assert report["mean_utility"] == pytest.approx((3.0 - 1.0) / 2)


def test_the_split_is_by_arrival_time() -> None:
    jobs = [job("late", 9.0, 1.0), job("early", 1.0, 1.0), job("mid", 5.0, 1.0)]
    train, test = split_by_arrival(jobs, 0.67)
    assert [j.job_id for j in train] == ["early", "mid"] and [j.job_id for j in test] == ["late"]
    with pytest.raises(ValueError):
        split_by_arrival(jobs, 1.0)


def test_the_command_reports_every_estimator_as_json(tmp_path, capsys) -> None:
    path = tmp_path / "estimators.json"
    assert main(["bench", "estimator", "--trace", str(SLICE), "--json", str(path)]) == 0
    results = json.loads(path.read_text())
    assert set(results) == {"fixed-2s", "eq2-empirical", "eq2-learned", "oracle"}
    for report in results.values():
        assert set(report) >= KEYS and report["num_calls"] > 0
    assert results["eq2-learned"]["fitted"] is True
    assert results["eq2-learned"]["pinball_loss"] > 0
    assert results["eq2-empirical"]["pinball_loss"] > 0
    assert results["fixed-2s"]["mean_ttl_s"] == 2.0
    assert "eq2-learned" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--max-jobs", "0"], "--max-jobs"),
    (["--train-fraction", "1.5"], "train_fraction"),
    (["--queueing-delay-s", "-1"], "--queueing-delay-s"),
])
def test_bad_arguments_are_reported_not_raised(args, message, capsys) -> None:
    assert main(["bench", "estimator", "--trace", str(SLICE), *args]) == 2
    assert message in capsys.readouterr().err
    assert main(["bench", "estimator", "--trace", "/no/such.jsonl"]) == 2
    assert "cannot read trace" in capsys.readouterr().err


def test_an_empty_training_split_still_reports(tmp_path) -> None:
    path = tmp_path / "cold.json"
    assert main(["bench", "estimator", "--trace", str(SLICE), "--train-fraction", "0",
                 "--max-jobs", "4", "--json", str(path)]) == 0
    results = json.loads(path.read_text())
    assert results["eq2-learned"]["fitted"] is False
    assert results["eq2-empirical"]["num_calls"] == 44
