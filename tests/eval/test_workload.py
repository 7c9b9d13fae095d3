"""Loading agent-job traces: token counts, truncation, the context split, synthesized tool
durations, and bad files."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from eval.arrivals import all_at_once_arrivals_s, arrivals_s, poisson_arrivals_s
from eval.workload import AgentJobSpec, LoadOptions, ToolDurationSampler, TurnSpec, load_jobs
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


def test_the_shared_quantiles_file_loads() -> None:
    shared = Path(__file__).resolve().parents[3] / "shared"
    path = shared / "traces/converted/tool_duration_quantiles.json"
    if not path.exists():
        pytest.skip("the shared traces are not beside this checkout")
    sampler = ToolDurationSampler.from_file(path)
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
