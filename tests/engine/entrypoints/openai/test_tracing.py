"""`CONTINUUM_TRACE_PATH` traces a live server; an agent job's turns are readable from it."""

from __future__ import annotations

from tests.engine.entrypoints.openai.conftest import start_server
from tracing.reader import read_trace
from tracing.records import PinPinned, PinReleased, PrefixCacheEvent, RequestArrived
from tracing.summary import summarize


def test_the_environment_variable_traces_a_served_agent_job(tmp_path, monkeypatch) -> None:
    path = tmp_path / "served.jsonl"
    monkeypatch.setenv("CONTINUUM_TRACE_PATH", str(path))
    server = start_server(policy_options={"estimator": "fixed-2s"})  # pins tool calls for 2 s
    try:
        client = server.client()
        first = client.completions.create(
            model="tiny", prompt=list(range(5, 70)), max_tokens=6,
            extra_body={"job_id": "agent", "tool_name": "bash", "ignore_eos": True,
                        "return_token_ids": True})
        context = first.choices[0].model_extra["prompt_token_ids"] + \
            first.choices[0].model_extra["token_ids"]
        client.completions.create(
            model="tiny", prompt=[*context, 80, 81], max_tokens=2,
            extra_body={"job_id": "agent", "is_last_step": True, "ignore_eos": True})
        server.wait_idle()
    finally:
        server.stop()

    trace = read_trace(path)
    arrived = [e for e in trace.events if isinstance(e, RequestArrived)]
    assert [(e.job_id, e.tool_name, e.is_last_turn) for e in arrived] == [
        ("agent", "bash", False), ("agent", None, True)]
    pinned = next(e for e in trace.events if isinstance(e, PinPinned))
    assert (pinned.ttl_s, pinned.inputs.source, pinned.inputs.tool) == (2.0, "fixed", "bash")
    hits = [e for e in trace.events if isinstance(e, PrefixCacheEvent)]
    assert hits[1].num_pin_hit_tokens == len(context) // 16 * 16
    released = [e.reason for e in trace.events if isinstance(e, PinReleased)]
    assert released == ["reused"]
    summary = summarize(trace)
    assert summary.num_jobs == 1 and summary.jobs[0].completion_s > 0
