"""Reading agent jobs' tool calls from the agent-job trace format."""

from __future__ import annotations

import json

import pytest

from estimator.traces import DEFAULT_TURN_TIME_S, read_trace_jobs


def test_both_token_layouts_are_read(tmp_path) -> None:
    path = tmp_path / "jobs.jsonl"
    swe = {"job_id": "a", "arrival_s": 5.0, "turns": [
        {"input_tokens": 100, "output_tokens": 20, "tool_name": "cat", "tool_duration_s": 0.2,
         "llm_latency_s": 3.0},
        {"input_tokens": 150, "output_tokens": 10, "tool_name": "ls", "tool_duration_s": None},
        {"input_tokens": 170, "output_tokens": 10, "tool_name": None, "tool_duration_s": None},
    ]}
    web = {"job_id": "b", "turns": [
        {"context_tokens_after": 397, "tool_name": "search", "tool_duration_s": 2.5},
        {"context_tokens_after": None, "tool_name": None, "tool_duration_s": None},
    ]}
    path.write_text(json.dumps(swe) + "\n\n" + json.dumps(web) + "\n")
    first, second = read_trace_jobs(path)
    assert (first.job_id, first.arrival_s, first.num_turns) == ("a", 5.0, 3)
    # A turn without a recorded tool time teaches nothing and is skipped.
    assert [(c.tool_name, c.duration_s, c.num_context_tokens, c.turn_time_s)
            for c in first.calls] == [("cat", 0.2, 120, 3.0)]
    assert [(c.tool_name, c.num_context_tokens, c.turn_time_s) for c in second.calls] == [
        ("search", 397, DEFAULT_TURN_TIME_S)]


@pytest.mark.parametrize("line", ["{", '{"job_id": "a"}', '{"job_id": "a", "turns": []}', "[1]"])
def test_malformed_lines_name_the_line(tmp_path, line) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"job_id": "ok", "turns": [{"tool_duration_s": null}]}\n' + line + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        read_trace_jobs(path)
    with pytest.raises(ValueError, match="cannot read trace"):
        read_trace_jobs(tmp_path / "missing.jsonl")
