"""`continuum bench throughput`: the engine against transformers on the tiny model."""

import json

import pytest

from engine.cli import main
from eval.gpu_floors import WorkloadCounts


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
    assert results["async_scheduling"] is False  # the default on CPU


def test_bench_throughput_reports_the_slowest_steps(tmp_path) -> None:
    out = tmp_path / "throughput.json"
    code = main(["bench", "throughput", "--impl", "engine", "--num-requests", "5",
                 "--prompt-len", "8", "24", "--output-len", "3", "9", "--max-model-len", "128",
                 "--num-kv-blocks", "64", "--slow-steps", "3", "--json", str(out)])
    assert code == 0
    results = json.loads(out.read_text())
    slow = results["slow_steps"]
    assert len(slow) == 3
    assert [step["wall_ms"] for step in slow] == sorted(
        (step["wall_ms"] for step in slow), reverse=True)
    assert all(0 <= step["index"] < results["num_steps"] for step in slow)
    assert slow[0]["wall_ms"] <= results["wall_s"] * 1e3
    assert all(step["allocator"] == {} for step in slow)  # no CUDA here
    for step in slow:
        # Each step launches one and (in order, the CPU's default) waits for it.
        assert step["submit_ms"] > 0 and step["wait_ms"] >= 0
        assert step["submit_ms"] + step["wait_ms"] <= step["wall_ms"]
        assert len(step["gc_collections"]) == 3 and step["gc_ms"] >= 0
        assert step["triton_compiles"] == []  # the tiny model runs torch's ops here
    assert results["allocator_steps"] == {"num_steps": 0, "wall_s": 0}
    # What bounds any run of the workload (eval.gpu_floors), for the report's floors.
    counts = WorkloadCounts(**results["workload"])
    assert counts.num_requests == 5 and counts.output_tokens == results["output_tokens"]
    assert 5 * 8 <= counts.prompt_tokens <= 5 * 24
    assert (results["model"], results["quantization"], results["kv_cache_dtype"]) == (
        "tiny", "none", "auto")


def test_bench_throughput_profiles_one_more_run(tmp_path, capsys) -> None:
    out = tmp_path / "throughput.json"
    code = main(["bench", "throughput", "--impl", "engine", "--num-requests", "3",
                 "--prompt-len", "8", "16", "--output-len", "2", "5", "--max-model-len", "128",
                 "--num-kv-blocks", "64", "--profile", "--json", str(out)])
    assert code == 0
    profile = json.loads(out.read_text())["profile"]
    assert profile["wall_s"] > 0
    # No device on the CPU: no kernels, so no busy time and no groups.
    assert profile["device_busy_s"] == 0 and profile["device_s_by_group"] == {}
    assert "profiled run" in capsys.readouterr().out


def test_bench_throughput_refuses_a_profile_of_both_sides(capsys) -> None:
    assert main(["bench", "throughput", "--profile"]) == 2
    assert "--impl engine" in capsys.readouterr().err


def test_a_profile_that_cannot_empty_the_prefix_cache_reports_why(capsys) -> None:
    from types import SimpleNamespace

    from eval.bench.throughput import _profile

    held = SimpleNamespace(engine=SimpleNamespace(reset_prefix_cache=lambda: False))
    profile = _profile(held, [[1, 2, 3]], [None])
    assert "could not be reset" in profile["error"]
    assert "warning" in capsys.readouterr().err
