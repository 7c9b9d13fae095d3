"""The discrete-event simulator on the real scheduler: deterministic, leak-free, and
measuring what the jobs saw; and the `bench sim` command's report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.cli import main as cli_main
from engine.executor.roofline import SIM_PROFILES
from eval.arrivals import poisson_arrivals_s
from eval.report import markdown_table, speedup
from eval.simulator import SimSettings, simulate
from eval.workload import AgentJobSpec, LoadOptions, TurnSpec, load_jobs
from tests.continuum.workload import TEST_DATA

SLICE = TEST_DATA / "minisweagent_deepseek_slice.jsonl"
RUN_FIELDS = {"mean_jct_s", "p90_jct_s", "p99_jct_s", "throughput_jobs_per_s",
              "cached_token_fraction", "preemptions"}


def slice_jobs(num_jobs: int = 6, max_turns: int = 5) -> list[AgentJobSpec]:
    return load_jobs(SLICE, LoadOptions(max_jobs=num_jobs, max_turns=max_turns,
                                        token_scale=0.1))


def pressured(policy: str, **overrides: object) -> SimSettings:
    """A pool of 64 blocks of 16 tokens: a few jobs' contexts fill it."""
    return SimSettings(policy=policy, num_kv_blocks=64, max_num_batched_tokens=512,
                       check_invariants=True, **overrides)


@pytest.mark.parametrize("policy", ["fcfs", "continuum", "continuum-fixed", "infercept",
                                    "autellix"])
def test_every_policy_finishes_every_job_without_leaks(policy: str) -> None:
    jobs = slice_jobs()
    metrics = simulate(jobs, poisson_arrivals_s(len(jobs), 20.0), pressured(policy))
    assert metrics.num_finished_jobs == metrics.num_jobs == len(jobs)
    assert metrics.num_turns == sum(len(job.turns) for job in jobs)
    assert metrics.leaked_blocks == 0 and metrics.failures == 0
    assert metrics.preemptions is not None and metrics.mean_queue_s is not None
    # Every job lasts at least its tool time.
    tools_s = [sum(t.tool_duration_s or 0.0 for t in job.turns) for job in jobs]
    assert metrics.p99_jct_s >= min(tools_s)
    assert 0.0 < metrics.cached_token_fraction < 1.0


def test_same_seed_same_run_and_other_arrivals_another() -> None:
    jobs = slice_jobs()
    arrivals = poisson_arrivals_s(len(jobs), 20.0, seed=0)
    first = simulate(jobs, arrivals, pressured("continuum"))
    assert simulate(jobs, arrivals, pressured("continuum")) == first
    other_arrivals = poisson_arrivals_s(len(jobs), 20.0, seed=1)
    assert simulate(jobs, other_arrivals, pressured("continuum")) != first


def test_one_turn_alone_takes_the_profile_time() -> None:
    job = AgentJobSpec("solo", (TurnSpec(320, 4, None, None),))
    metrics = simulate([job], [0.0], SimSettings(policy="fcfs", num_kv_blocks=64))
    profile = SIM_PROFILES["h100-llama3.1-8b"]
    expected_s = profile.step_time_s([(0, 320)]) + sum(
        profile.step_time_s([(320 + i, 1)]) for i in range(3)
    )
    assert metrics.mean_jct_s == pytest.approx(expected_s)
    assert metrics.mean_ttft_s == pytest.approx(profile.step_time_s([(0, 320)]))
    assert metrics.mean_queue_s == 0.0 and metrics.busy_fraction == pytest.approx(1.0)


def test_next_turn_reuses_the_context_after_the_tool() -> None:
    job = AgentJobSpec("j", (TurnSpec(64, 16, "t", 5.0), TurnSpec(16, 1, None, None)))
    metrics = simulate([job], [0.0], SimSettings(policy="continuum-fixed", num_kv_blocks=64))
    # Turn 1's prompt is 96 tokens. Turn 0 computed the KV of 79 of them (its last sampled
    # token's never was): four whole blocks, a 64-token hit kept by the pin.
    assert metrics.cached_token_fraction == pytest.approx(64 / (64 + 96))
    assert metrics.mean_jct_s > 5.0


def test_bench_sim_writes_every_field_per_policy_and_load(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "sim.json"
    plot = tmp_path / "sim.png"
    code = cli_main([
        "bench", "sim", "--trace", str(SLICE), "--num-jobs", "4", "--max-turns", "3",
        "--token-scale", "0.1", "--num-kv-blocks", "64", "--max-num-batched-tokens", "512",
        "--policies", "fcfs,continuum", "--jobs-per-s", "5,all", "--json", str(out),
        "--plot", str(plot),
    ])
    assert code == 0
    report = json.loads(out.read_text())
    runs = report["runs"]
    assert [(run["policy"], run["jobs_per_s"]) for run in runs] == [
        ("fcfs", 5.0), ("continuum", 5.0), ("fcfs", None), ("continuum", None)]
    assert all(set(run) >= RUN_FIELDS for run in runs)
    assert report["workload"]["num_jobs"] == 4 and report["profile"] == "h100-llama3.1-8b"
    assert plot.read_bytes().startswith(b"\x89PNG")
    table = capsys.readouterr().out
    assert "| 5 | continuum |" in table and "| all at once | fcfs |" in table


def test_bench_sim_refuses_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli_main(["bench", "sim", "--trace", str(tmp_path / "none.jsonl"),
                     "--jobs-per-s", "1"]) == 2
    assert "cannot read trace" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["bench", "sim", "--trace", str(SLICE), "--jobs-per-s", "0"])


def test_report_table_and_speedup() -> None:
    def run(policy: str, load: float, jct: float) -> dict:
        return {"policy": policy, "jobs_per_s": load, "mean_jct_s": jct, "p90_jct_s": jct,
                "p99_jct_s": jct, "mean_queue_s": None, "cached_token_fraction": 0.5,
                "preemptions": None}
    runs = [run("fcfs", 1.0, 30.0), run("continuum", 1.0, 15.0), run("continuum", 2.0, 9.0)]
    assert speedup(runs, runs[1]) == 2.0 and speedup(runs, runs[2]) is None
    assert "| 1 | continuum | 15.0 | 15.0 | 15.0 | 2.00x | - | 50.0% | - |" in markdown_table(runs)
