"""The replay client against a real server (uvicorn, engine-core process, tiny model)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.cli import main as cli_main
from eval.arrivals import poisson_arrivals_s
from eval.replay_client import AgentReplay, ReplaySettings
from eval.workload import AgentJobSpec, LoadOptions, TurnSpec, load_jobs
from tests.continuum.workload import TEST_DATA
from tests.engine.entrypoints.openai.conftest import ServerThread, start_server

SLICE = TEST_DATA / "minisweagent_deepseek_slice.jsonl"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    running = start_server(num_kv_blocks=128, max_model_len=1024)
    yield running
    running.stop()


def five_jobs() -> list[AgentJobSpec]:
    return load_jobs(SLICE, LoadOptions(max_jobs=5, max_turns=4, token_scale=0.05))


def test_five_jobs_replay_with_exact_prompts_and_no_leftovers(server: ServerThread) -> None:
    jobs = five_jobs()
    done = []
    replay = AgentReplay(jobs, poisson_arrivals_s(len(jobs), 10.0),
                         ReplaySettings(base_url=server.base_url), on_job_done=done.append)
    metrics = asyncio.run(replay.run())
    assert metrics.failures == 0 and metrics.num_finished_jobs == 5 and len(done) == 5
    assert metrics.num_turns == 20
    for job, record in zip(jobs, replay.records, strict=True):
        # The server saw each turn's prompt at exactly the trace's length: previous prompt +
        # generated tokens + appended tokens, with outputs forced to their lengths.
        assert [t.num_prompt_tokens for t in record.turns] == [
            job.prompt_len(k) for k in range(len(job.turns))]
        assert [t.num_output_tokens for t in record.turns] == [
            t.num_output_tokens for t in job.turns]
        assert record.jct_s >= sum(t.tool_duration_s or 0.0 for t in job.turns)
    # Later turns extend earlier ones, so the prefix cache serves part of their prompts.
    later_cached = [t.num_cached_tokens for r in replay.records for t in r.turns[1:]]
    assert sum(later_cached) > 0 and 0 < metrics.cached_token_fraction < 1
    assert metrics.mean_ttft_s > 0 and metrics.mean_queue_s is None
    assert metrics.preemptions is not None and metrics.pins_created is not None
    assert metrics.recomputed_tokens is not None
    stats = server.wait_idle()
    assert stats.num_pins == 0  # every job's last turn ended it
    assert stats.num_free_blocks == stats.num_kv_blocks


def test_a_failing_job_is_counted_and_the_others_finish(server: ServerThread) -> None:
    too_long = AgentJobSpec("too-long", (TurnSpec(50, 2, "t", 0.0), TurnSpec(2000, 2, None, None)))
    jobs = [*five_jobs()[:2], too_long]
    replay = AgentReplay(jobs, [0.0, 0.0, 0.0], ReplaySettings(base_url=server.base_url))
    metrics = asyncio.run(replay.run())
    assert metrics.failures == 1 and metrics.num_finished_jobs == 2
    error = replay.records[2].error
    assert error is not None and error.startswith("turn 1: BadRequestError")
    server.wait_idle()


def test_text_prompts_for_servers_without_token_ids(server: ServerThread) -> None:
    jobs = five_jobs()[:2]
    replay = AgentReplay(jobs, [0.0, 0.0],
                         ReplaySettings(base_url=server.base_url, prompt_format="text"))
    metrics = asyncio.run(replay.run())
    assert metrics.failures == 0 and metrics.num_turns == 8
    assert metrics.cached_token_fraction > 0


def test_bench_agent_command_writes_the_run(server: ServerThread, tmp_path: Path) -> None:
    out = tmp_path / "agent.json"
    code = cli_main([
        "bench", "agent", "--base-url", server.base_url, "--trace", str(SLICE),
        "--first-jobs", "2", "--max-turns", "2", "--token-scale", "0.05", "--jobs-per-s", "5",
        "--label", "continuum", "--no-progress", "--json", str(out),
    ])
    assert code == 0
    run, = json.loads(out.read_text())["runs"]
    assert run["policy"] == "continuum" and run["jobs_per_s"] == 5.0
    assert {"mean_jct_s", "p90_jct_s", "p99_jct_s", "throughput_jobs_per_s",
            "cached_token_fraction", "preemptions", "recomputed_tokens", "failures"} <= set(run)
    assert run["num_finished_jobs"] == 2


def test_bench_agent_takes_the_base_url_with_or_without_v1(server: ServerThread,
                                                          capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    for base_url in (server.base_url + "/v1", server.base_url + "/v1/"):
        assert ReplaySettings(base_url=base_url).base_url == server.base_url
        code = cli_main(["bench", "agent", "--base-url", base_url, "--trace", str(SLICE),
                         "--first-jobs", "1", "--max-turns", "2", "--token-scale", "0.05",
                         "--no-progress"])
        assert code == 0, capsys.readouterr().err
    code = cli_main(["bench", "agent", "--base-url", "127.0.0.1:8000", "--trace", str(SLICE),
                     "--no-progress"])
    assert code == 2 and "base_url must be an http(s) URL" in capsys.readouterr().err


def test_a_stopped_replay_cancels_its_turns_and_counts_unfinished_jobs(
        server: ServerThread) -> None:
    quick = AgentJobSpec("quick", (TurnSpec(20, 4, None, None),))
    in_tool = AgentJobSpec("in-tool", (TurnSpec(20, 4, "bash", 600.0), TurnSpec(8, 4, None, None)))
    streaming = AgentJobSpec("streaming", (TurnSpec(20, 900, None, None),))
    late = AgentJobSpec("late", (TurnSpec(20, 4, None, None),))
    replay = AgentReplay([quick, in_tool, streaming, late], [0.0, 0.0, 1.8, 600.0],
                         ReplaySettings(base_url=server.base_url))
    metrics = asyncio.run(replay.run(stop_after_s=2.0))
    assert metrics.num_jobs == 4 and metrics.num_finished_jobs == 1 and metrics.failures == 0
    quick_record, in_tool_record, streaming_record, late_record = replay.records
    assert quick_record.finished_s is not None and quick_record.finished_s <= 2.0
    assert len(in_tool_record.turns) == 1 and in_tool_record.finished_s is None
    assert streaming_record.finished_s is None and streaming_record.error is None
    assert late_record.turns == [] and late_record.arrival_s == 600.0
    assert [record.job_id for record in replay.started] == ["quick", "in-tool", "streaming"]
    server.wait_idle()  # the cancelled turn's request was aborted with its connection


def test_stop_after_s_must_be_positive(server: ServerThread) -> None:
    replay = AgentReplay(five_jobs()[:1], [0.0], ReplaySettings(base_url=server.base_url))
    with pytest.raises(ValueError, match="stop_after_s"):
        asyncio.run(replay.run(stop_after_s=0.0))
