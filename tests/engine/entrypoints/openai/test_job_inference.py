"""Clients that send no job fields still get job turns: the engine infers the job from the
prompt, and the second turn of a tool-calling chat reuses the pin of the first. Also
`prompt_cache_key`, OpenAI's cache hint, taken as the job when no `job_id` is given.

The scripted executor makes every request answer with a Hermes tool call to `bash`; the
`continuum` policy reads it from the output and pins the turn for Eq. 2's cold-start TTL,
made positive by a prefill profile in which rebuilding a context is slow.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.entrypoints.openai.errors import APIError
from engine.entrypoints.openai.job_extension import job_info
from engine.entrypoints.openai.protocol import JobFields
from engine.entrypoints.openai.serving import ServerSettings
from engine.entrypoints.openai.tenants import Tenants
from engine.request import JobInfo
from tests.continuum.priced import PRICED_CONTINUUM_PATH
from tests.engine.entrypoints.openai.conftest import SCRIPTED, ServerThread, start_server
from tracing.reader import read_trace
from tracing.records import PinPinned, PinReleased, PrefixCacheEvent, RequestArrived

TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "run a command",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}]
QUESTION = [{"role": "system", "content": "You are a careful shell assistant."},
            {"role": "user", "content": "Which files are in the working directory?"}]
BLOCK_SIZE = 16


def _start(tmp_path: Path, **overrides) -> ServerThread:
    profile = tmp_path / "prefill.json"  # 100 s per prompt token: every rebuild is costly
    profile.write_text(json.dumps({"points": [[16, 1600.0], [64, 6400.0], [256, 25600.0]]}))
    return start_server(
        executor=f"{SCRIPTED}:ScriptedExecutor", scheduling_policy=PRICED_CONTINUUM_PATH,
        policy_options={"prefill_profile": str(profile)},
        trace_path=str(tmp_path / "trace.jsonl"), **overrides,
    )


def _two_turns(server: ServerThread, model: str, api_key: str | None = None):
    """A tool-calling chat as an agent SDK runs it, with no job fields: the question, then
    the conversation with the assistant's tool call and the tool's result appended."""
    client = server.client(api_key=api_key) if api_key else server.client()
    first = client.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS,
                                           max_tokens=200)
    conversation = _continuation(first)
    second = client.chat.completions.create(model=model, messages=conversation, tools=TOOLS,
                                            max_tokens=200)
    return first, second, conversation


def _continuation(first) -> list[dict]:
    """The conversation after `first`: its tool call and the tool's result appended."""
    message = first.choices[0].message
    (call,) = message.tool_calls
    return [
        *QUESTION,
        {"role": "assistant", "content": message.content,
         "tool_calls": [{"id": call.id, "type": "function",
                         "function": {"name": call.function.name,
                                      "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "README.md\nsetup.py\nsrc"},
    ]


def test_a_client_without_job_fields_reuses_its_first_turns_pin(tmp_path: Path) -> None:
    tenants = Tenants.from_pairs([("key-a", "a"), ("key-b", "b")])
    server = _start(tmp_path, api_key="key-a",
                    settings=ServerSettings(served_model_name="scripted", tenants=tenants))
    try:
        first, second, conversation = _two_turns(server, "scripted")
        assert first.choices[0].finish_reason == "tool_calls"
        full_prompt_blocks = first.usage.prompt_tokens // BLOCK_SIZE * BLOCK_SIZE
        assert second.usage.prompt_tokens_details.cached_tokens >= full_prompt_blocks
        server.wait_idle()
        assert server.metric("pins_released_total", 'reason="reused"') == 1
        assert server.metric("pins_created_total") == 2  # each tool-calling turn was pinned

        # Tenant b sends tenant a's second turn word for word: its own cache, its own job.
        server.client(api_key="key-b").chat.completions.create(
            model="scripted", messages=conversation, tools=TOOLS, max_tokens=200)
        server.wait_idle()
        assert server.metric("pins_released_total", 'reason="reused"') == 1
    finally:
        server.stop()

    events = read_trace(tmp_path / "trace.jsonl").events
    first_turn, second_turn, other_tenant = [e for e in events if isinstance(e, RequestArrived)]
    assert first_turn.job_inferred and first_turn.inferred_from is None
    assert first_turn.job_id.startswith("a/~inferred/")  # tenant a's, as its named jobs
    assert (second_turn.job_id, second_turn.job_inferred, second_turn.inferred_from) == (
        first_turn.job_id, True, first_turn.request_id)
    assert other_tenant.job_inferred and other_tenant.inferred_from is None
    assert other_tenant.job_id != first_turn.job_id
    assert other_tenant.job_id.startswith("b/~inferred/")
    pinned = next(e for e in events if isinstance(e, PinPinned))
    assert (pinned.request_id, pinned.inputs.tool) == (first_turn.request_id, "bash")
    assert pinned.ttl_s > 0
    reused = [e for e in events if isinstance(e, PinReleased) and e.reason == "reused"]
    assert [e.request_id for e in reused] == [first_turn.request_id]
    hit = next(e for e in events if isinstance(e, PrefixCacheEvent)
               and e.request_id == second_turn.request_id)
    assert hit.num_pin_hit_tokens >= full_prompt_blocks
    other_hit = next(e for e in events if isinstance(e, PrefixCacheEvent)
                     and e.request_id == other_tenant.request_id)
    assert other_hit.num_hit_tokens == 0


def test_tenants_that_share_the_prefix_cache_keep_their_own_jobs(tmp_path: Path) -> None:
    tenants = Tenants.from_pairs([("key-a", "a"), ("key-b", "b")], share_prefix_cache=True)
    server = _start(tmp_path, api_key="key-a",
                    settings=ServerSettings(served_model_name="scripted", tenants=tenants))
    try:
        alpha, beta = server.client(api_key="key-a"), server.client(api_key="key-b")
        first = alpha.chat.completions.create(model="scripted", messages=QUESTION,
                                              tools=TOOLS, max_tokens=200)
        conversation = _continuation(first)  # it holds a's tool call id
        intruder = beta.chat.completions.create(model="scripted", messages=conversation,
                                                tools=TOOLS, max_tokens=200)
        assert intruder.usage.prompt_tokens_details.cached_tokens >= BLOCK_SIZE  # shared
        alpha.chat.completions.create(model="scripted", messages=conversation, tools=TOOLS,
                                      max_tokens=200)
        server.wait_idle()
    finally:
        server.stop()
    arrived = [e for e in read_trace(tmp_path / "trace.jsonl").events
               if isinstance(e, RequestArrived)]
    first_turn, other_tenant, second_turn = arrived
    assert other_tenant.inferred_from is None and other_tenant.job_id != first_turn.job_id
    assert (second_turn.job_id, second_turn.inferred_from) == (
        first_turn.job_id, first_turn.request_id)


def test_turning_inference_off_leaves_requests_without_a_job(tmp_path: Path) -> None:
    server = _start(tmp_path, job_inference=False,
                    settings=ServerSettings(served_model_name="scripted"))
    try:
        _two_turns(server, "scripted")
        server.wait_idle()
        assert server.metric("pins_created_total") == 0
        assert server.metric("num_jobs") == 0
    finally:
        server.stop()
    arrived = [e for e in read_trace(tmp_path / "trace.jsonl").events
               if isinstance(e, RequestArrived)]
    assert [(e.job_id, e.job_inferred) for e in arrived] == [(None, False), (None, False)]


def test_prompt_cache_key_names_the_job(tmp_path: Path) -> None:
    server = _start(tmp_path, settings=ServerSettings(served_model_name="scripted"))
    try:
        client = server.client()
        client.chat.completions.create(model="scripted", messages=QUESTION, max_tokens=200,
                                       extra_body={"prompt_cache_key": "session-7"})
        with server.http() as http:
            state = http.get("/v1/jobs/session-7").json()
        assert state["pin"]["num_blocks"] > 0
        client.completions.create(model="scripted", prompt="hello", max_tokens=5,
                                  extra_body={"prompt_cache_key": "session-7",
                                              "job_id": "explicit"})
    finally:
        server.stop()
    arrived = [e for e in read_trace(tmp_path / "trace.jsonl").events
               if isinstance(e, RequestArrived)]
    assert [(e.job_id, e.job_inferred) for e in arrived] == [
        ("session-7", False), ("explicit", False)]


@pytest.mark.parametrize(("body", "headers", "expected"), [
    ({"prompt_cache_key": "k"}, {}, JobInfo(job_id="k")),
    ({"prompt_cache_key": "k", "job_id": "j"}, {}, JobInfo(job_id="j")),
    ({"prompt_cache_key": "k"}, {"x-job-id": "h"}, JobInfo(job_id="h")),
    ({"prompt_cache_key": "k", "tool_name": "bash"}, {}, JobInfo(job_id="k", tool_name="bash")),
])
def test_prompt_cache_key_is_the_job_unless_one_is_named(body, headers, expected) -> None:
    assert job_info(JobFields(**body), headers) == expected


@pytest.mark.parametrize(("body", "headers", "param"), [
    ({"job_id": "~inferred/0/x"}, {}, "job_id"),
    ({}, {"x-job-id": "~inferred/1/y"}, "job_id"),
    ({"prompt_cache_key": "~inferred/2/z"}, {}, "prompt_cache_key"),
])
def test_inferred_job_ids_are_reserved(body, headers, param) -> None:
    with pytest.raises(APIError, match="reserved") as raised:
        job_info(JobFields(**body), headers)
    assert (raised.value.status_code, raised.value.param) == (400, param)
