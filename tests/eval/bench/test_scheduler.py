"""`continuum bench scheduler`: its figures, and a pool too small for the batch."""

import json

import pytest

from engine.cli import main


def test_bench_scheduler_writes_its_figures(tmp_path, capsys) -> None:
    out = tmp_path / "bench.json"
    code = main(["bench", "scheduler", "--num-requests", "8", "--num-blocks", "256",
                 "--prompt-len", "32", "--steps", "20", "--warmup-steps", "2",
                 "--json", str(out)])
    assert code == 0
    results = json.loads(out.read_text())
    assert results["num_running"] == 8
    assert results["steps"] == 20
    assert 0 < results["median_us"] <= results["p99_us"]
    assert "median_us" in capsys.readouterr().out


def test_bench_scheduler_samples_only_where_a_step_completes_a_prompt(tmp_path) -> None:
    """50 prompts of 200 tokens against a step's 8,192-token budget: the first step computes
    part of the 41st prompt, and samples nothing for it."""
    out = tmp_path / "bench.json"
    code = main(["bench", "scheduler", "--num-requests", "50", "--num-blocks", "1024",
                 "--prompt-len", "200", "--steps", "4", "--warmup-steps", "1",
                 "--policy", "continuum", "--json", str(out)])
    assert code == 0
    assert json.loads(out.read_text())["num_running"] == 50


def test_bench_scheduler_reports_a_pool_too_small() -> None:
    with pytest.raises(ValueError, match="raise --num-blocks"):
        main(["bench", "scheduler", "--num-requests", "8", "--num-blocks", "40",
              "--prompt-len", "64", "--steps", "50", "--warmup-steps", "0"])
