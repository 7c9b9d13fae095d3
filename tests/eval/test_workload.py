"""Loading agent-job traces: token counts, truncation, the context split, synthesized tool
durations, bad files; drawing jobs with replacement, turn scaling, and chat sessions."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from eval.arrivals import (
    all_at_once_arrivals_s,
    arrivals_s,
    poisson_arrivals_s,
    poisson_arrivals_within_s,
)
from eval.workload import (
    AgentJobSpec,
    ChatTurnSpec,
    LoadOptions,
    ToolDurationSampler,
    TurnSpec,
    draw_jobs,
    draw_sessions,
    load_chat_sessions,
    load_jobs,
    repeat_turns,
)
from eval.workloads import TOOL_QUANTILES_PATH, get_workload
from tests.continuum.workload import TEST_DATA

SLICE = TEST_DATA / "minisweagent_deepseek_slice.jsonl"
QUANTILES = {"ALL": {"p10": 1.0, "p25": 2.0, "p50": 3.0, "p75": 4.0, "p90": 5.0, "p95": 6.0,
                     "p99": 7.0, "max": 8.0},
             "search": {"p10": 10.0, "p25": 10.0, "p50": 10.0, "p75": 10.0, "p90": 10.0,
                        "p95": 10.0, "p99": 10.0, "max": 10.0}}


def write_jobs(path: Path, *jobs: dict) -> Path:
    path.write_text("".join(json.dumps(job) + "\n" for job in jobs))
    return path


def test_token_counts_and_tools_of_the_slice() -> None:
    jobs = load_jobs(SLICE)
    raw = [json.loads(line) for line in SLICE.read_text().splitlines()]
    assert len(jobs) == len(raw) == 16
    for job, record in zip(jobs, raw, strict=True):
        assert job.job_id == record["job_id"] and len(job.turns) == 12
        for index, (turn, source) in enumerate(zip(job.turns, record["turns"], strict=True)):
            assert job.prompt_len(index) == source["input_tokens"]
            assert turn.num_output_tokens == source["output_tokens"]
            assert turn.tool_name == source["tool_name"]
            assert turn.tool_duration_s == source["tool_duration_s"]
        assert job.turns[-1].tool_duration_s is None


def test_truncation_and_job_limit() -> None:
    jobs = load_jobs(SLICE, LoadOptions(max_jobs=3, max_turns=4))
    assert len(jobs) == 3
    assert all(len(job.turns) == 4 and job.turns[-1].tool_duration_s is None for job in jobs)
    assert all(t.tool_duration_s is not None for job in jobs for t in job.turns[:-1])


def test_token_scale_shrinks_counts_but_keeps_one_output_token() -> None:
    full = load_jobs(SLICE, LoadOptions(max_jobs=1))[0]
    small = load_jobs(SLICE, LoadOptions(max_jobs=1, token_scale=0.01))[0]
    assert small.turns[0].num_appended_tokens == round(full.turns[0].num_appended_tokens * 0.01)
    assert all(turn.num_output_tokens >= 1 for turn in small.turns)


def test_context_tokens_after_is_split_with_the_assumed_output(tmp_path: Path) -> None:
    path = write_jobs(
        tmp_path / "web.jsonl",
        {"job_id": "a", "turns": [
            {"context_tokens_after": 400, "tool_name": "search", "tool_duration_s": 2.0},
            {"context_tokens_after": 1400, "tool_name": "fetch", "tool_duration_s": 1.0},
            {"context_tokens_after": None, "tool_name": None, "tool_duration_s": None}]},
        {"job_id": "b", "turns": [{"context_tokens_after": None, "tool_duration_s": None}]},
    )
    a, b = load_jobs(path, LoadOptions(output_tokens_per_turn=80))
    # Prompts 320 and 1320 (each context less its 80 output tokens); the last turn appends
    # the mean of the later turns' appended counts (1320 - 400 = 920).
    assert [t.num_appended_tokens for t in a.turns] == [320, 920, 920]
    assert [t.num_output_tokens for t in a.turns] == [80, 80, 80]
    assert a.prompt_len(1) == 1320 and a.prompt_len(2) == 1400 + 920
    # A job that records no context gets the median first prompt of the others.
    assert b.turns == (TurnSpec(320, 80, None, None),)


def test_missing_tool_durations_are_synthesized_per_tool_and_seed(tmp_path: Path) -> None:
    turns = [{"input_tokens": 10 * (k + 1), "appended_tokens": 10, "output_tokens": 5,
              "tool_name": name, "tool_duration_s": None, "est": True}
             for k, name in enumerate(["search", "cd", "search", None])]
    path = write_jobs(tmp_path / "bfcl.jsonl", {"job_id": "j", "turns": turns})
    sampler = ToolDurationSampler(QUANTILES)
    job = load_jobs(path, tool_durations=sampler)[0]
    durations = [turn.tool_duration_s for turn in job.turns]
    assert durations[0] == durations[2] == 10.0  # the tool's own (constant) quantiles
    assert 0.5 <= durations[1] <= 8.0  # an unknown tool draws from ALL
    assert durations[3] is None and job.tokens_estimated
    assert load_jobs(path, tool_durations=sampler) == [job]
    other = load_jobs(path, LoadOptions(seed=1), tool_durations=sampler)[0]
    assert other.turns[1].tool_duration_s != durations[1]
    with pytest.raises(ValueError, match="no tool_duration_s"):
        load_jobs(path)


def test_sampler_follows_the_quantiles() -> None:
    sampler = ToolDurationSampler(QUANTILES)
    rng = random.Random(0)
    draws = sorted(sampler.sample_s(None, rng) for _ in range(20_000))
    assert draws[len(draws) // 2] == pytest.approx(3.0, abs=0.1)
    assert draws[int(len(draws) * 0.9)] == pytest.approx(5.0, abs=0.1)
    assert draws[0] >= 0.5 and draws[-1] <= 8.0


def test_the_shipped_quantiles_file_loads() -> None:
    sampler = ToolDurationSampler.from_file(TOOL_QUANTILES_PATH)
    assert sampler.sample_s("cat", random.Random(0)) < 61


@pytest.mark.parametrize(("content", "message"), [
    ("", "no jobs"),
    ("not json\n", "not JSON"),
    ('{"job_id": "x", "turns": []}\n', "non-empty list"),
    ('{"turns": [{"input_tokens": 1, "output_tokens": 1}]}\n', "not an agent job"),
])
def test_bad_traces_are_refused_with_the_line(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_jobs(path)
    with pytest.raises(ValueError, match="cannot read trace"):
        load_jobs(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="max_turns"):
        LoadOptions(max_turns=0)
    with pytest.raises(ValueError, match="ALL"):
        ToolDurationSampler({"cat": QUANTILES["ALL"]})


def test_job_lengths() -> None:
    job = AgentJobSpec("j", (TurnSpec(10, 2, "t", 1.0), TurnSpec(3, 4, None, None)))
    assert job.prompt_len(0) == 10 and job.prompt_len(1) == 15
    assert job.max_seq_len == 19 and job.num_output_tokens == 6


def test_arrivals() -> None:
    times = poisson_arrivals_s(2000, 4.0, seed=3)
    assert times[0] == 0.0 and times == sorted(times)
    assert times[-1] / (len(times) - 1) == pytest.approx(0.25, rel=0.1)
    assert poisson_arrivals_s(5, 4.0, seed=3) == times[:5]
    assert poisson_arrivals_s(5, 4.0, seed=4) != times[:5]
    assert all_at_once_arrivals_s(3) == [0.0, 0.0, 0.0] == arrivals_s(3, None)
    with pytest.raises(ValueError, match="jobs_per_s"):
        poisson_arrivals_s(3, 0.0)


def test_poisson_arrivals_within_a_window_are_a_prefix_of_the_process() -> None:
    within = poisson_arrivals_within_s(50.0, 2.0, seed=7)
    longer = poisson_arrivals_s(len(within) + 1, 2.0, seed=7)
    assert within == longer[:-1] and within[-1] <= 50.0 < longer[-1]
    assert poisson_arrivals_within_s(0.0, 2.0) == [0.0]


# Drawing with replacement, turn scaling, chat sessions


def test_drawn_jobs_are_distinct_deterministic_and_from_the_trace() -> None:
    jobs = load_jobs(SLICE, LoadOptions(max_jobs=3, max_turns=2))
    drawn = draw_jobs(jobs, 10, seed=4)
    assert [job.job_id.rsplit("~", 1)[1] for job in drawn] == [str(k) for k in range(10)]
    by_id = {job.job_id: job for job in jobs}
    for job in drawn:
        assert job.turns == by_id[job.job_id.rsplit("~", 1)[0]].turns
    assert len({job.job_id.rsplit("~", 1)[0] for job in drawn}) > 1  # with replacement
    assert draw_jobs(jobs, 10, seed=4) == drawn
    assert draw_jobs(jobs, 4, seed=4) == drawn[:4]
    assert draw_jobs(jobs, 10, seed=5) != drawn
    with pytest.raises(ValueError, match=">= 1"):
        draw_jobs(jobs, 0, seed=0)


def test_repeat_turns_scales_tokens_and_joins_with_the_median_tool() -> None:
    job = AgentJobSpec("j", (TurnSpec(100, 9, "ls", 3.0), TurnSpec(7, 4, "cat", 1.0),
                             TurnSpec(0, 1, "find", 2.0), TurnSpec(41, 10, "submit", None)))
    repeated = repeat_turns(job, 3, ("find", 2.0))
    assert len(repeated.turns) == 12 and repeated.job_id == "j"
    # Each count divided by 3 and rounded; a count that was not 0 stays at least 1.
    once = [(33, 3, "ls", 3.0), (2, 1, "cat", 1.0), (0, 1, "find", 2.0)]
    joined = [*once, (14, 3, "find", 2.0)]
    last = [*once, (14, 3, "submit", None)]
    assert [(t.num_appended_tokens, t.num_output_tokens, t.tool_name, t.tool_duration_s)
            for t in repeated.turns] == joined + joined + last
    assert repeat_turns(job, 1, None) == job


def test_repeat_turns_when_loading_picks_the_median_call_and_a_pooled_one(
        tmp_path: Path) -> None:
    def turn(tokens: int, tool: str | None, duration_s: float | None) -> dict:
        return {"input_tokens": tokens, "output_tokens": 6, "tool_name": tool,
                "tool_duration_s": duration_s}
    path = write_jobs(
        tmp_path / "jobs.jsonl",
        {"job_id": "a", "turns": [turn(60, "slow", 9.0), turn(90, "fast", 1.0),
                                  turn(120, "mid", 4.0), turn(200, "mid", 4.0),
                                  turn(300, "last", None)]},
        {"job_id": "b", "turns": [turn(30, "alone", None)]},
    )
    a, b = load_jobs(path, LoadOptions(repeat_turns=2))
    # a's calls by duration: fast 1.0, mid 4.0 (turn 2), mid 4.0 (turn 3), slow 9.0: the
    # lower median is the turn-2 call.
    assert (a.turns[4].tool_name, a.turns[4].tool_duration_s) == ("mid", 4.0)
    assert [t.num_appended_tokens for t in a.turns[:5]] == [30, 12, 12, 37, 47]
    # b has no call of its own: the median of every job's calls (a's four).
    assert (b.turns[0].tool_name, b.turns[0].tool_duration_s) == ("mid", 4.0)
    assert b.turns[1].tool_duration_s is None and len(b.turns) == 2
    assert b.turns[0].num_appended_tokens == 15 and b.turns[0].num_output_tokens == 3
    with pytest.raises(ValueError, match="repeat_turns"):
        LoadOptions(repeat_turns=0)


def test_chat_sessions_take_their_gaps_from_the_arrival_times(tmp_path: Path) -> None:
    path = write_jobs(
        tmp_path / "chat.jsonl",
        {"job_id": "s", "turns": [
            {"t_arrival_s": 10.0, "input_tokens": 100, "output_tokens": 20,
             "gap_from_parent_arrival_s": None, "tool_duration_s": None},
            {"t_arrival_s": 40.0, "input_tokens": 130, "output_tokens": 5,
             "gap_from_parent_arrival_s": 30.0, "tool_duration_s": None},
            # A branch from turn 0 whose prompt shrank: replayed linearly, appending nothing.
            {"t_arrival_s": 45.0, "input_tokens": 110, "output_tokens": 8,
             "gap_from_parent_arrival_s": 35.0, "tool_duration_s": None}]},
        {"job_id": "t", "turns": [
            {"input_tokens": 50, "output_tokens": 5},
            {"input_tokens": 60, "output_tokens": 5, "gap_from_parent_arrival_s": 12.5}]},
    )
    s, t = load_chat_sessions(path)
    assert s.turns == (ChatTurnSpec(100, 20, 30.0), ChatTurnSpec(10, 5, 5.0),
                       ChatTurnSpec(0, 8, None))
    assert s.max_seq_len == 143
    assert t.turns == (ChatTurnSpec(50, 5, 12.5), ChatTurnSpec(5, 5, None))
    half = load_chat_sessions(path, token_scale=0.5)[1]
    assert half.turns == (ChatTurnSpec(25, 2, 12.5), ChatTurnSpec(2, 2, None))
    drawn = draw_sessions([s, t], 6, seed=0)
    assert [d.session_id.rsplit("~", 1)[1] for d in drawn] == [str(k) for k in range(6)]
    assert draw_sessions([s, t], 6, seed=0) == drawn


def test_chat_sessions_need_their_turns_timed(tmp_path: Path) -> None:
    path = write_jobs(tmp_path / "agent.jsonl", {"job_id": "x", "turns": [
        {"input_tokens": 50, "output_tokens": 5, "tool_duration_s": 1.0},
        {"input_tokens": 60, "output_tokens": 5, "tool_duration_s": None}]})
    with pytest.raises(ValueError, match=r"agent.jsonl:1: not a chat session: .*t_arrival_s"):
        load_chat_sessions(path)


def test_the_mooncake_sessions_load_as_chat() -> None:
    sessions = load_chat_sessions(get_workload("mooncake").path)
    assert len(sessions) == 8057
    second = next(s for s in sessions if s.session_id == "mooncake-1")
    assert second.turns == (ChatTurnSpec(7322, 490, 48.0), ChatTurnSpec(21, 374, None))
