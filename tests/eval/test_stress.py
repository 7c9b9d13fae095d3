"""The load test and the soak run in reduced form against a real `continuum serve` subprocess
(the full runs: `continuum bench load` and `continuum bench soak`, see docs/benchmarks.md),
and the pure pieces they are built from."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from engine.cli import main as cli_main
from eval.bench_load import LoadTestReport, LoadTestSettings, run_load_test
from eval.bench_soak import SoakSettings, fresh_jobs, run_soak
from eval.load_requests import DISCONNECTED, ERROR, OK, check_answer, sse_lines
from eval.load_test import LoadMix, LoadSettings, LoadTally, RequestBudget
from eval.server_process import (
    ServerProcess,
    ServerSpec,
    descendant_pids,
    parse_prometheus,
    read_rss_mib,
)
from eval.stress import Check, EngineEndState, MemoryFigures, markdown_figures, passed
from eval.workload import AgentJobSpec, LoadOptions, TurnSpec, load_jobs
from tests.continuum.workload import TEST_DATA
from tests.eval import sabotaged_policy

SLICE = TEST_DATA / "minisweagent_deepseek_slice.jsonl"
REPO_ROOT = Path(__file__).resolve().parents[2]
SERVE_ARGS = ("--num-kv-blocks", "256", "--max-model-len", "1024",
              "--policy-option", "estimator=fixed-2s", "--policy-option", "prefill_profile=none",
              "--debug-check-invariants", "--no-job-inference")  # as bench load's defaults


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """One server for both reduced runs, its core checking invariants after every step.
    Stopping it must end the engine core too, cleanly."""
    running = ServerProcess(ServerSpec(serve_args=SERVE_ARGS)).start()
    pids = running.process_ids()
    assert len(pids) >= 2  # the engine core is a child process
    yield running
    assert running.stop() == 0 and not running.is_running()
    assert all(read_rss_mib(pid) is None for pid in pids)


def test_reduced_load_test_leaves_no_leaks_pins_or_errors(server: ServerProcess) -> None:
    load = LoadSettings(num_clients=120, num_requests=400, time_limit_s=300.0,
                        request_timeout_s=60.0, max_tokens=4, long_max_tokens=32,
                        job_turns=(2, 4), tool_gap_s=(0.05, 0.2), seed=7)
    report = run_load_test(server, LoadTestSettings(load=load))
    tally = report.tally
    assert report.passed, markdown_figures(report.figures(), report.checks)
    assert tally.num_sent == 400 and not tally.errors and tally.cut_at_time_limit == 0
    assert report.warmup.num_sent == 240 and not report.warmup.errors
    assert tally.peak_in_flight >= 100
    assert set(tally.sent) == {"stream_completion", "completion", "stream_chat", "chat",
                               "stream_disconnect", "give_up", "agent_turn"}
    assert tally.outcomes[OK] > 200 and tally.outcomes[DISCONNECTED] > 0
    # Every request ended one way or another, and no job was left open.
    assert sum(tally.outcomes.values()) == tally.num_sent
    assert tally.jobs["ended_by_last_step"] > 0 and tally.jobs["ended_by_delete"] > 0
    assert (tally.jobs["ended_by_last_step"] + tally.jobs["ended_by_delete"]
            + tally.jobs["cut_short"]) == tally.jobs["started"]
    assert report.pins_created is not None and sum(report.pins_created) > 0  # pins were made
    state, memory = report.end_state, report.memory
    assert state is not None and memory is not None
    assert state.total_blocks == 256 and state.leaked_blocks == 0
    assert state.num_pins == 0 and state.pinned_blocks == 0 and state.num_jobs == 0
    assert memory.growth_mib <= memory.bound_mib
    assert server.metrics()["continuum:invariant_checks_total"] > 0


def test_reduced_soak_keeps_invariants_with_no_leaks(server: ServerProcess) -> None:
    jobs = load_jobs(SLICE, LoadOptions(max_turns=4, token_scale=0.05))
    settings = SoakSettings(duration_s=15.0, warmup_s=4.0, num_lanes=8, max_tool_s=0.5,
                            request_timeout_s=60.0, sample_interval_s=0.5)
    started_s = time.monotonic()
    report = run_soak(server, jobs, settings)
    assert report.passed, markdown_figures(report.figures(), report.checks)
    assert time.monotonic() - started_s < 120.0  # the lanes stop starting jobs at 15 s
    tally = report.tally
    assert tally.jobs_completed >= 8 and tally.failed_jobs == 0
    assert tally.turns_completed >= 4 * tally.jobs_completed
    assert report.counters["invariant_checks"] > 0
    assert report.counters["invariant_checks"] == report.counters["engine_steps"]
    assert report.invariant_violations == 0 and tally.health_failures == 0
    assert tally.health_polls >= 10  # every 0.5 s, slower when the machine is busy
    state, memory = report.end_state, report.memory
    assert state is not None and state.leaked_blocks == 0 and state.num_pins == 0
    assert memory is not None and memory.growth_mib <= memory.bound_mib


def test_the_soak_reports_a_broken_invariant(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The checker is not vacuous: a policy that corrupts the running list after ten
    finished requests stops the core, and the soak says so."""
    # The engine core imports the policy by its dotted path, from wherever pytest runs.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    serve_args = ("--scheduling-policy", f"{sabotaged_policy.__name__}:SabotagedPolicy",
                  "--num-kv-blocks", "64", "--max-model-len", "1024",
                  "--debug-check-invariants")
    jobs = load_jobs(SLICE, LoadOptions(max_jobs=4, max_turns=4, token_scale=0.05))
    settings = SoakSettings(duration_s=8.0, warmup_s=0.0, num_lanes=4, max_tool_s=0.2,
                            sample_interval_s=0.25, idle_timeout_s=5.0)
    log_path = tmp_path / "serve.log"
    with ServerProcess(ServerSpec(serve_args=serve_args), log_path) as server:
        report = run_soak(server, jobs, settings)
    failed = {check.name for check in report.checks if not check.passed}
    assert {"no invariant violation", "no failed job"} <= failed and not report.passed
    assert report.invariant_violations == 1
    assert "AssertionError: a request runs twice" in log_path.read_text()


# The pieces


def test_rss_of_a_process_and_of_a_missing_one(tmp_path: Path) -> None:
    assert 1.0 < (read_rss_mib(os.getpid()) or 0.0) < 100_000.0
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "status").write_text("Name:\tx\nVmPeak:\t 9 kB\nVmRSS:\t  3072 kB\n")
    (tmp_path / "43").mkdir()
    (tmp_path / "43" / "status").write_text("Name:\tzombie\nState:\tZ\n")
    assert read_rss_mib(42, tmp_path) == 3.0
    assert read_rss_mib(43, tmp_path) is None  # a zombie has no memory line
    assert read_rss_mib(44, tmp_path) is None


def test_descendants_are_found_through_odd_command_names(tmp_path: Path) -> None:
    parents = {10: 1, 11: 10, 12: 11, 13: 10, 20: 1}
    for pid, parent in parents.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (odd) name (x) S {parent} 1 1 0\n")
    (tmp_path / "self").mkdir()
    assert descendant_pids(10, tmp_path) == [11, 13, 12]
    assert descendant_pids(20, tmp_path) == []


def test_prometheus_samples_are_summed_over_labels() -> None:
    text = ("# HELP continuum:num_pins Live pins.\n# TYPE continuum:num_pins gauge\n"
            'continuum:num_pins{model_name="tiny"} 2.0\n'
            'continuum:pins_released_total{model_name="tiny",reason="reused"} 3.0\n'
            'continuum:pins_released_total{model_name="tiny",reason="expired"} 4.0\n'
            "plain_metric 1e3\nnot a sample\n")
    assert parse_prometheus(text) == {"continuum:num_pins": 2.0,
                                      "continuum:pins_released_total": 7.0,
                                      "plain_metric": 1000.0}


def test_server_spec_owns_host_and_port() -> None:
    with pytest.raises(ValueError, match="--port"):
        ServerSpec(serve_args=("--port", "8000"))
    with pytest.raises(ValueError, match="--host"):
        ServerSpec(serve_args=("--host=0.0.0.0",))


def test_a_server_that_cannot_start_reports_its_log(tmp_path: Path) -> None:
    spec = ServerSpec(serve_args=("--max-model-len", "999999", "--num-kv-blocks", "4"))
    with pytest.raises(RuntimeError, match="exited") as error:
        ServerProcess(spec, tmp_path / "serve.log").start()
    assert "cannot start" in str(error.value)


def _end_state(**overrides: int | bool) -> EngineEndState:
    values: dict[str, int | bool] = {
        "idle": True, "num_running": 0, "num_waiting": 0, "total_blocks": 64,
        "free_blocks": 64, "num_pins": 0, "pinned_blocks": 0, "num_jobs": 0, **overrides}
    return EngineEndState(**values)  # type: ignore[arg-type]


def test_end_state_checks_fail_on_leaks_pins_and_jobs() -> None:
    assert passed(_end_state().checks())
    metrics = {"continuum:kv_cache_total_blocks": 64.0, "continuum:kv_cache_free_blocks": 60.0,
               "continuum:num_pins": 1.0, "continuum:pinned_blocks": 4.0}
    state = EngineEndState.from_metrics(metrics, idle=True)
    assert state.leaked_blocks == 4
    failed = {check.name for check in state.checks() if not check.passed}
    assert failed == {"no leaked KV blocks", "no pins left"}
    assert not passed(_end_state(num_jobs=1).checks())
    assert not passed(_end_state(idle=False, num_running=2).checks())
    # A server that exposes no pool at all must not pass as leak-free.
    assert not passed(EngineEndState.from_metrics({}, idle=True).checks())


def test_memory_check_against_the_bound() -> None:
    memory = MemoryFigures(start_rss_mib=500.0, baseline_rss_mib=600.0, end_rss_mib=664.0,
                           peak_rss_mib=700.0, bound_mib=64.0)
    assert memory.growth_mib == 64.0 and memory.check().passed
    grown = replace(memory, end_rss_mib=664.5)
    assert not grown.check().passed and "+64.5 MiB" in grown.check().detail
    assert memory.to_dict()["growth_mib"] == 64.0


def test_a_report_passes_only_if_every_check_did() -> None:
    assert not passed([])
    checks = (Check("a", True, ""), Check("b", False, "why"))
    report = LoadTestReport(LoadTally(), LoadTally(), _end_state(), MemoryFigures(1, 1, 1, 1, 64),
                            (0, 0), checks)
    assert not report.passed
    assert "| b | FAIL | why |" in markdown_figures(report.figures(), report.checks)
    assert report.to_dict()["passed"] is False


def test_complete_answers_must_have_the_forced_length() -> None:
    body = {"max_tokens": 4, "return_token_ids": True}
    assert check_answer(body, "length", {"completion_tokens": 4}, (1, 2, 3, 4)).outcome == OK
    assert check_answer(body, "stop", {"completion_tokens": 4}, (1, 2, 3, 4)).outcome == ERROR
    assert check_answer(body, "length", {"completion_tokens": 3}, (1, 2, 3)).outcome == ERROR
    assert check_answer(body, "length", None, (1, 2, 3, 4)).outcome == ERROR
    assert check_answer(body, "length", {"completion_tokens": 4}, (1,)).outcome == ERROR


def test_event_stream_lines_split_only_at_cr_and_lf() -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for chunk in (b'data: {"text": "a\xe2\x80\xa8b\xc2\x85c"}\r', b"\n\r\nda",
                      b"ta: [DONE]\n\n", b"tail"):
            yield chunk

    async def collect() -> list[str]:
        return [line async for line in sse_lines(chunks())]

    assert asyncio.run(collect()) == [
        'data: {"text": "a\u2028b\u0085c"}', "", "data: [DONE]", "", "tail"]


def test_the_budget_hands_out_requests_until_count_or_time_runs_out() -> None:
    budget = RequestBudget(5, deadline_s=time.monotonic() + 60.0)
    assert [budget.take(3), budget.take(3), budget.take(1)] == [3, 2, 0]
    assert budget.exhausted()
    late = RequestBudget(5, deadline_s=time.monotonic() - 1.0)
    assert late.take(1) == 0 and late.exhausted()


def test_load_settings_are_validated() -> None:
    with pytest.raises(ValueError):
        LoadSettings(num_clients=0)
    with pytest.raises(ValueError):
        LoadSettings(max_tokens=65, long_max_tokens=64)
    with pytest.raises(ValueError):
        LoadSettings(tool_gap_s=(0.5, 0.1))
    with pytest.raises(ValueError):
        LoadMix(agent_job=-1.0)
    with pytest.raises(ValueError):
        LoadMix(**dict.fromkeys(("stream_completion", "completion", "stream_chat", "chat",
                                 "stream_disconnect", "give_up", "agent_job"), 0.0))
    with pytest.raises(ValueError):
        SoakSettings(duration_s=10.0, warmup_s=10.0)


def test_soak_jobs_cycle_under_fresh_ids_with_capped_tools() -> None:
    job = AgentJobSpec("j", (TurnSpec(10, 2, "bash", 30.0), TurnSpec(5, 2, None, None)))
    jobs = fresh_jobs([job], max_tool_s=1.5)
    first, second = next(jobs), next(jobs)
    assert first.job_id != second.job_id and first.job_id.endswith("j")
    assert [t.tool_duration_s for t in first.turns] == [1.5, None]
    assert next(fresh_jobs([job], max_tool_s=None)).turns[0].tool_duration_s == 30.0


def test_bench_commands_refuse_bad_arguments_and_servers_that_do_not_start(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli_main(["bench", "load", "--clients", "0"]) == 2
    assert cli_main(["bench", "load", "--serve-args", "--port 8000"]) == 2
    assert cli_main(["bench", "soak", "--trace", str(SLICE), "--duration-s", "5",
                     "--warmup-s", "9"]) == 2
    assert capsys.readouterr().err.count("error:") == 3
    # A server that cannot start is reported with its log, and is a failure.
    assert cli_main(["bench", "load", "--serve-args=--num-kv-blocks 4 --max-model-len 4096"]) == 1
    assert "cannot start" in capsys.readouterr().err
