"""The discrete-event simulator on the real scheduler: deterministic, leak-free, and
measuring what the jobs saw; and the `bench sim` command's report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.cli import main as cli_main
from engine.executor.roofline import SIM_PROFILES
from engine.scheduler.policy_registry import make_policy
from eval import simulator
from eval.arrivals import poisson_arrivals_s
from eval.policy_variants import EVAL_POLICIES
from eval.report import markdown_table, speedup
from eval.simulator import ChatLoad, SimSettings, Simulation, simulate
from eval.workload import (
    AgentJobSpec,
    ChatSessionSpec,
    ChatTurnSpec,
    LoadOptions,
    TurnSpec,
    load_jobs,
)
from tests.continuum.workload import TEST_DATA
from tracing.reader import read_trace
from tracing.summary import summarize

SLICE = TEST_DATA / "minisweagent_deepseek_slice.jsonl"
RUN_FIELDS = {"mean_jct_s", "p90_jct_s", "p99_jct_s", "throughput_jobs_per_s",
              "cached_token_fraction", "preemptions", "recomputed_tokens"}


def slice_jobs(num_jobs: int = 6, max_turns: int = 5) -> list[AgentJobSpec]:
    return load_jobs(SLICE, LoadOptions(max_jobs=num_jobs, max_turns=max_turns,
                                        token_scale=0.1))


def pressured(policy: str, **overrides: object) -> SimSettings:
    """A pool of 64 blocks of 16 tokens: a few jobs' contexts fill it."""
    return SimSettings(policy=policy, num_kv_blocks=64, max_num_batched_tokens=512,
                       check_invariants=True, **overrides)


@pytest.mark.parametrize("policy", ["fcfs", "job-fcfs", "continuum", "continuum-fixed",
                                    "continuum-oracle", "infercept", "autellix"])
def test_every_policy_finishes_every_job_without_leaks(policy: str) -> None:
    jobs = slice_jobs()
    metrics = simulate(jobs, poisson_arrivals_s(len(jobs), 20.0), pressured(policy))
    assert metrics.num_finished_jobs == metrics.num_jobs == len(jobs)
    assert metrics.num_turns == sum(len(job.turns) for job in jobs)
    assert metrics.leaked_blocks == 0 and metrics.failures == 0
    assert metrics.preemptions is not None and metrics.mean_queue_s is not None
    assert metrics.recomputed_tokens is not None
    # Every job lasts at least its tool time.
    tools_s = [sum(t.tool_duration_s or 0.0 for t in job.turns) for job in jobs]
    assert metrics.p99_jct_s >= min(tools_s)
    assert 0.0 < metrics.cached_token_fraction < 1.0


@pytest.mark.parametrize("policy", ["fcfs", "continuum"])
def test_host_tier_brings_back_what_the_small_pool_let_go(policy: str) -> None:
    jobs = slice_jobs()
    arrivals = poisson_arrivals_s(len(jobs), 20.0)
    without = simulate(jobs, arrivals, pressured(policy))
    run = Simulation(jobs, arrivals, pressured(policy, kv_offload_gib=0.5))
    with_tier = run.run()
    assert with_tier.num_finished_jobs == with_tier.num_jobs == len(jobs)
    assert with_tier.leaked_blocks == 0 and with_tier.failures == 0
    assert without.host_hit_token_fraction is None and without.host_stored_tokens is None
    # Turns find their earlier context in the tier (256 blocks) after the pool (64) evicted it.
    assert run.executor.num_host_kv_blocks == 256
    assert 0.0 < with_tier.host_hit_token_fraction < 1.0
    assert with_tier.host_stored_tokens > 0 and with_tier.host_loaded_tokens > 0
    assert with_tier.cached_token_fraction > without.cached_token_fraction
    assert 0.0 < run.executor.kv_copy_s < run.executor.busy_s
    # Every host block is accounted for: the only ones referenced are the stores of the
    # last finished turns, queued for a step that never came.
    transfers = run.core.scheduler.kv_cache_manager.transfers
    assert transfers is not None
    transfers.check_invariants()
    referenced = [block for block in transfers.host_tier.blocks if block.ref_cnt]
    assert len(referenced) == transfers.num_pending
    assert 0 < transfers.host_tier.num_used_blocks * 16 <= with_tier.host_stored_tokens


@pytest.mark.parametrize(("policy", "options"), [
    ("fcfs", ()),
    # Continuum's whole-prompt admission leaves this workload no preemption to count.
    (EVAL_POLICIES["continuum-af226d3"], ()),
])
def test_recomputed_tokens_are_the_traces(tmp_path: Path, policy: str,
                                         options: tuple[tuple[str, str], ...]) -> None:
    jobs = slice_jobs(num_jobs=4, max_turns=3)
    trace_path = tmp_path / "trace.jsonl"
    settings = SimSettings(policy=policy, policy_options=options, num_kv_blocks=32,
                           max_num_batched_tokens=512, trace_path=str(trace_path))
    metrics = simulate(jobs, [0.0] * len(jobs), settings)  # all at once: the pool overflows
    summary = summarize(read_trace(trace_path))
    assert metrics.preemptions == summary.preemptions > 0
    assert metrics.recomputed_tokens == summary.recomputed_tokens > 0


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


def test_the_step_budget_is_the_prefill_chunk() -> None:
    """`max_num_batched_tokens` is honoured: at vLLM's 2,048 a 4,096-token prompt takes two
    prefill steps, at 8,192 one."""
    job = AgentJobSpec("long", (TurnSpec(4096, 1, None, None),))
    profile = SIM_PROFILES["h100-llama3.1-8b"]
    ttfts = {budget: simulate([job], [0.0], SimSettings(
        policy="fcfs", num_kv_blocks=512, max_num_batched_tokens=budget)).mean_ttft_s
        for budget in (2048, 8192)}
    assert ttfts[2048] == pytest.approx(
        profile.step_time_s([(0, 2048)]) + profile.step_time_s([(2048, 2048)]))
    assert ttfts[8192] == pytest.approx(profile.step_time_s([(0, 4096)]))


def test_policy_options_reach_the_policy() -> None:
    jobs = slice_jobs()
    arrivals = poisson_arrivals_s(len(jobs), 20.0)
    fixed = simulate(jobs, arrivals, pressured(
        "continuum", policy_options=(("estimator", "fixed-2s"), ("max_pinned_fraction", "1"))))
    # The 2 s rule pins every non-final turn (with no cap on the pool's share that pins
    # hold); the paper's cold start prices these short contexts near zero, and Eq. 2 over
    # the observed durations pins some of them.
    assert fixed.pins_created == sum(len(job.turns) - 1 for job in jobs)
    papers_k = pressured(EVAL_POLICIES["continuum-as-replayed"])
    assert simulate(jobs, arrivals, papers_k).pins_created == 0
    assert 0 < simulate(jobs, arrivals, pressured("continuum")).pins_created < fixed.pins_created
    with pytest.raises(ValueError, match="bogus"):
        Simulation(jobs, arrivals, pressured("continuum", policy_options=(("bogus", "1"),)))


def test_the_oracle_is_told_each_tools_true_duration(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[dict] = []

    def spy(name: str, options: dict | None = None, **kwargs: object) -> object:
        built.append({"name": name, **kwargs})
        return make_policy(name, options, **kwargs)

    monkeypatch.setattr(simulator, "make_policy", spy)
    jobs = slice_jobs()
    chat = ChatLoad((ChatSessionSpec("chat", (ChatTurnSpec(32, 4, 0.5),
                                               ChatTurnSpec(8, 4, None))),), (0.0,))
    run = Simulation(jobs, poisson_arrivals_s(len(jobs), 20.0),
                     pressured("continuum-oracle"), chat)
    metrics = run.run()
    assert metrics.num_finished_jobs == len(jobs) and metrics.leaked_blocks == 0
    oracle, = built
    assert oracle["name"] == EVAL_POLICIES["continuum-oracle"]
    lookup = oracle["tool_duration_s"]
    for job in jobs:
        assert [lookup(f"{job.job_id}#{k}") for k in range(len(job.turns))] == [
            turn.tool_duration_s for turn in job.turns]
    assert lookup("chat#0") is None and lookup("unknown#0") is None
    simulate(jobs[:1], [0.0], pressured("continuum"))
    assert "tool_duration_s" not in built[-1]


def mixed_sessions() -> ChatLoad:
    """Two chat sessions: one waits 5 s between its turns, one sends at once."""
    return ChatLoad((
        ChatSessionSpec("slow", (ChatTurnSpec(48, 8, 5.0), ChatTurnSpec(20, 4, None))),
        ChatSessionSpec("eager", (ChatTurnSpec(40, 6, 0.0), ChatTurnSpec(10, 2, 0.0),
                                  ChatTurnSpec(10, 2, None))),
    ), (0.1, 0.2))


def test_chat_sessions_run_beside_the_jobs_and_are_reported_apart() -> None:
    jobs = slice_jobs(num_jobs=3, max_turns=3)
    arrivals = poisson_arrivals_s(len(jobs), 20.0)
    alone = simulate(jobs, arrivals, pressured("continuum"))
    run = Simulation(jobs, arrivals, pressured("continuum"), mixed_sessions())
    mixed = run.run()
    # The job figures count the jobs only.
    assert mixed.num_jobs == alone.num_jobs == 3 and mixed.num_turns == alone.num_turns
    assert mixed.leaked_blocks == 0 and alone.chat_num_requests is None
    assert 0 < mixed.busy_fraction <= 1.0
    assert (mixed.chat_num_sessions, mixed.chat_num_requests) == (2, 5)
    assert mixed.chat_queue_p50_s is not None and mixed.chat_queue_p99_s is not None
    assert 0 < mixed.chat_ttft_p50_s <= mixed.chat_ttft_p99_s
    assert mixed.p50_queue_s is not None and mixed.p99_queue_s >= mixed.p50_queue_s
    slow, eager = run.records[3:]
    # The next turn comes the gap after the previous one arrived, not before its answer.
    assert 0.1 + 5.0 < slow.finished_s < 0.1 + 5.5
    assert eager.finished_s < 1.0
    # Each prompt extends the previous prompt and answer, so the cache serves it.
    assert [turn.num_prompt_tokens for turn in eager.turns] == [40, 56, 68]
    assert all(turn.num_cached_tokens >= 32 for turn in eager.turns[1:])


def test_bench_sim_writes_every_field_per_policy_and_load(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "sim.json"
    plot = tmp_path / "sim.png"
    code = cli_main([
        "bench", "sim", "--trace", str(SLICE), "--first-jobs", "4", "--max-turns", "3",
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
    assert "| preemptions | recomputed tokens |" in table


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
    table = markdown_table(runs)
    assert "| 1 | continuum | 15.0 | 15.0 | 15.0 | 2.00x | - | 50.0% | - | - |" in table
    runs[0] |= {"preemptions": 3, "recomputed_tokens": 12_345}
    table = markdown_table(runs)
    assert "| 1 | fcfs | 30.0 | 30.0 | 30.0 | 1.00x | - | 50.0% | 3 | 12,345 |" in table
