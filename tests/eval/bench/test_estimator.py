"""`continuum bench estimator`: every estimator's report under both scorings, the command's
JSON, a named workload, and bad arguments reported rather than raised."""

from __future__ import annotations

import argparse
import json

import pytest

from engine.cli import main as cli_main
from eval.bench.estimator import add_arguments, main
from tests.continuum.workload import TEST_DATA

SLICE = TEST_DATA / "minisweagent_deepseek_slice.jsonl"
KEYS = {"pin_rate", "hit_rate", "wasted_pin_s", "mean_ttl_s", "mean_held_s", "mean_T_s",
        "mean_utility", "mean_utility_handed_T", "mean_utility_ttl_cost_handed_T", "handed_T"}


def run(args: list[str]) -> int:
    """`continuum bench estimator` with these arguments."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return main(parser.parse_args(args))


def test_the_command_reports_every_estimator_under_both_scorings(tmp_path, capsys) -> None:
    path = tmp_path / "estimators.json"
    assert run(["--trace", str(SLICE), "--json", str(path)]) == 0
    results = json.loads(path.read_text())
    assert set(results) == {"fixed-2s", "eq2-empirical", "eq2-learned", "oracle",
                            "eq2-empirical+expected-hold", "eq2-learned+expected-hold"}
    for report in results.values():
        assert set(report) >= KEYS and report["num_calls"] > 0
        handed = report["handed_T"]
        assert report["mean_utility_handed_T"] == handed["mean_utility"]
        assert report["mean_utility_ttl_cost_handed_T"] == handed["mean_utility_ttl_cost"]
        assert report["mean_utility_ttl_cost_handed_T"] <= report["mean_utility_handed_T"]
    assert results["eq2-learned"]["fitted"] is True
    assert results["eq2-learned"]["pinball_loss"] > 0
    assert results["eq2-empirical"]["pinball_loss"] > 0
    assert results["fixed-2s"]["mean_ttl_s"] == 2.0
    assert results["eq2-empirical"]["handed_T"]["mean_T_s"] == 2.0
    assert 0 < results["eq2-empirical"]["mean_T_s"] <= 2.0
    oracle_report = results["oracle"]
    assert oracle_report["mean_utility"] == oracle_report["mean_utility_ttl_cost_handed_T"]
    for name, report in results.items():
        assert report["mean_utility"] <= oracle_report["mean_utility"] + 1e-12, name
    out = capsys.readouterr().out
    assert "new scoring (mean_utility)" in out
    assert "old scoring (mean_utility_ttl_cost_handed_T)" in out
    assert out.count("eq2-learned ") == 2 and out.count("eq2-learned+expected-hold") == 2


@pytest.mark.parametrize("args, message", [
    (["--max-jobs", "0"], "--max-jobs"),
    (["--train-fraction", "1.5"], "train_fraction"),
    (["--queueing-delay-s", "-1"], "--queueing-delay-s"),
    (["--queueing-delay-s", "inf"], "--queueing-delay-s"),
])
def test_bad_arguments_are_reported_not_raised(args, message, capsys) -> None:
    assert run(["--trace", str(SLICE), *args]) == 2
    assert message in capsys.readouterr().err
    assert run(["--trace", "/no/such.jsonl"]) == 2
    assert "cannot read trace" in capsys.readouterr().err


def test_an_empty_training_split_still_reports(tmp_path) -> None:
    path = tmp_path / "cold.json"
    assert run(["--trace", str(SLICE), "--train-fraction", "0", "--max-jobs", "4",
                "--json", str(path)]) == 0
    results = json.loads(path.read_text())
    assert results["eq2-learned"]["fitted"] is False
    assert results["eq2-empirical"]["num_calls"] == 44
    assert results["eq2-empirical"]["handed_T"]["num_calls"] == 44


def test_bench_estimator_takes_a_workload(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["bench", "estimator", "--workload", "swesmith",
                     "--train-fraction", "0"]) == 0
    assert "continuum_swesmith_test5_jobs.jsonl: 5 jobs" in capsys.readouterr().out
