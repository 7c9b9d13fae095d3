import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.cli import main

ROOT = Path(__file__).resolve().parents[2]


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


def test_bench_scheduler_reports_a_pool_too_small() -> None:
    with pytest.raises(ValueError, match="raise --num-blocks"):
        main(["bench", "scheduler", "--num-requests", "8", "--num-blocks", "40",
              "--prompt-len", "64", "--steps", "50", "--warmup-steps", "0"])


def test_console_script_help_lists_commands() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "engine.cli", "bench", "--help"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )
    assert "scheduler" in result.stdout


def test_unknown_command_exits_with_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as excinfo:
        main(["bench", "nope"])
    assert excinfo.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_bench_throughput_compares_the_engine_with_transformers(tmp_path) -> None:
    out = tmp_path / "throughput.json"
    code = main(["bench", "throughput", "--num-requests", "6", "--prompt-len", "8", "24",
                 "--output-len", "4", "12", "--hf-batch-size", "4", "--max-model-len", "128",
                 "--num-kv-blocks", "64", "--json", str(out)])
    assert code == 0
    results = json.loads(out.read_text())
    for key in ("tokens_per_s", "hf_tokens_per_s", "ratio", "engine_efficiency"):
        assert results[key] > 0
    assert results["ratio"] == pytest.approx(results["tokens_per_s"] / results["hf_tokens_per_s"])
    assert 0 < results["engine_efficiency"] <= 1
    assert results["num_requests"] == 6
