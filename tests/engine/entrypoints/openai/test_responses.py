"""POST /v1/responses (OpenAI's Responses API) through the openai SDK and raw HTTP against
real servers: the tiny model (random weights), and the scripted executor whose every output
is a Hermes tool call, so that function calls are deterministic. Also the stored responses:
previous_response_id chains as one job, GET / DELETE, store=false, eviction, tenants."""

from __future__ import annotations

import asyncio
import json
import tracemalloc
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest

from engine.entrypoints.openai.errors import APIError
from engine.entrypoints.openai.protocol_responses import ResponsesRequest
from engine.entrypoints.openai.response_store import (
    ENTRY_OVERHEAD_BYTES,
    ResponseStore,
    StoredResponse,
    item_json,
)
from engine.entrypoints.openai.serving import ServerSettings
from engine.entrypoints.openai.serving_responses import template_messages
from engine.entrypoints.openai.tenants import Tenants
from tests.engine.entrypoints.openai.conftest import ServerThread, start_server
from tests.engine.entrypoints.openai.scripted import PIN_TTL_S

BLOCK_SIZE = 16
TOOLS = [{"type": "function", "name": "bash", "description": "run a command",
          "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}]
NO_EOS = {"ignore_eos": True}
MESSAGE_EVENTS = ["response.output_item.added", "response.content_part.added",
                  "response.output_text.delta", "response.output_text.done",
                  "response.content_part.done", "response.output_item.done"]
CALL_EVENTS = ["response.output_item.added", "response.function_call_arguments.delta",
               "response.function_call_arguments.done", "response.output_item.done"]


def _scripted_http(server: ServerThread) -> httpx.Client:
    return server.http(headers={"Authorization": "Bearer secret-key"})


def _events(response: httpx.Response) -> list[tuple[str, dict]]:
    """(event name, data) of each SSE event of a streamed response."""
    events = []
    for block in response.text.split("\n\n"):
        if not block:
            continue
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        events.append((lines["event"], json.loads(lines["data"])))
    return events


def _collapse(names: list[str]) -> list[str]:
    """The names with runs of deltas collapsed into one."""
    return [name for i, name in enumerate(names)
            if not (name.endswith(".delta") and i and names[i - 1] == name)]


# Creating responses.
def test_create_with_a_string(server):
    response = server.client().responses.create(
        model="tiny", input="Hello there", max_output_tokens=5, temperature=0.0,
        metadata={"purpose": "test"}, extra_body=NO_EOS)
    assert response.id.startswith("resp_")
    assert response.object == "response"
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.status == "incomplete"
    (part,) = message.content
    assert part.type == "output_text" and part.annotations == []
    assert response.output_text == part.text
    usage = response.usage
    assert usage.output_tokens == 5
    assert usage.total_tokens == usage.input_tokens + 5
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert usage.input_tokens_details.cached_tokens >= 0
    assert (response.model, response.temperature, response.max_output_tokens) == ("tiny", 0.0, 5)
    assert response.metadata == {"purpose": "test"}
    assert response.tools == [] and response.tool_choice == "auto"
    assert response.parallel_tool_calls is True
    assert response.text.format.type == "text"
    assert response.model_extra["store"] is True


def test_items_and_instructions_are_rendered(server):
    client = server.client()
    items = [
        {"role": "system", "content": "You are terse."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "hello", "annotations": []}]},
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "how are you?"},
    ]
    instructions = "Think step by step before answering."
    plain = client.responses.create(model="tiny", input=items, max_output_tokens=2,
                                    store=False, extra_body=NO_EOS)
    instructed = client.responses.create(model="tiny", input=items, max_output_tokens=2,
                                         instructions=instructions, store=False,
                                         extra_body=NO_EOS)
    assert plain.usage.input_tokens > len("You are terse.hihelloAnswer in French.how are you?")
    # The tiny tokenizer is byte-level: the instructions add at least their bytes.
    assert instructed.usage.input_tokens >= plain.usage.input_tokens + len(instructions)
    assert instructed.instructions == instructions


def test_structured_output_follows_the_json_schema(server):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "mood": {"enum": ["happy", "sad"]}},
              "required": ["ok", "mood"], "additionalProperties": False}
    response = server.client().responses.create(
        model="tiny", input="Report.", max_output_tokens=40, store=False, extra_body={"seed": 3},
        text={"format": {"type": "json_schema", "name": "report", "schema": schema,
                         "strict": True}})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema"


def test_a_forced_function_is_called_and_named_to_the_scheduler(server):
    tools = [{"type": "function", "name": "bash", "parameters": {
        "type": "object", "properties": {"command": {"enum": ["ls", "pwd"]}},
        "required": ["command"], "additionalProperties": False}}]
    response = server.client().responses.create(
        model="tiny", input="List the files.", tools=tools, max_output_tokens=60,
        tool_choice={"type": "function", "name": "bash"},
        extra_body={"seed": 1, "job_id": "forced-call"})
    calls = [item for item in response.output if item.type == "function_call"]
    (call,) = calls
    assert call.name == "bash"
    assert json.loads(call.arguments)["command"] in ("ls", "pwd")
    assert response.tool_choice.name == "bash"
    with server.http() as http:
        books = http.get("/v1/jobs/forced-call").json()["policy"]
    assert books["last_tool_name"] == "bash"


def test_logprobs_are_included_when_asked(server):
    response = server.client().responses.create(
        model="tiny", input="hi", max_output_tokens=4, top_logprobs=2, store=False,
        include=["message.output_text.logprobs"], extra_body=NO_EOS)
    logprobs = response.output[0].content[0].logprobs
    assert len(logprobs) == 4
    for entry in logprobs:
        assert entry.logprob <= 0.0 and len(entry.top_logprobs) == 2


# Streaming.
def test_stream_events_in_order_and_deltas_make_the_text(server):
    with server.http() as http:
        raw = http.post("/v1/responses", json={
            "model": "tiny", "input": "Tell me more", "max_output_tokens": 6, "stream": True,
            "temperature": 0.0, "ignore_eos": True})
    assert raw.headers["content-type"].startswith("text/event-stream")
    events = _events(raw)
    names = [name for name, _ in events]
    assert [data["type"] for _, data in events] == names
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert _collapse(names) == ["response.created", "response.in_progress", *MESSAGE_EVENTS,
                                "response.incomplete"]
    text = "".join(data["delta"] for name, data in events if name.endswith("text.delta"))
    final = events[-1][1]["response"]
    assert final["output"][0]["content"][0]["text"] == text
    assert final["usage"]["output_tokens"] == 6
    first = events[0][1]["response"]
    assert first["id"] == final["id"] and first["status"] == "in_progress"


def test_streaming_matches_the_whole_response(server):
    client = server.client()
    kwargs = {"model": "tiny", "input": "Once", "max_output_tokens": 8, "temperature": 0.0,
              "store": False, "extra_body": NO_EOS}
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == whole.output_text
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output_text == text


def test_the_sdk_stream_helper_reads_text_and_function_calls(scripted_server):
    client = scripted_server.client()
    with client.responses.stream(model="scripted", input="what is here?", tools=TOOLS,
                                 max_output_tokens=200) as stream:
        names = [event.type for event in stream]
        final = stream.get_final_response()
    assert _collapse(names) == ["response.created", "response.in_progress", *MESSAGE_EVENTS,
                                *CALL_EVENTS, "response.completed"]
    assert final.status == "completed"
    assert final.output_text == "Let me look."
    message, call = final.output
    assert message.id.startswith("msg_")
    assert (call.type, call.name, json.loads(call.arguments)) == (
        "function_call", "bash", {"command": "ls -la"})


def test_a_failure_after_the_stream_started_is_a_failed_response(scripted_server):
    """The scripted executor ignores the grammar of a forced function, so the core ends the
    request with an error once the stream is under way."""
    with _scripted_http(scripted_server) as http:
        raw = http.post("/v1/responses", json={
            "model": "scripted", "input": "go", "tools": TOOLS, "max_output_tokens": 200,
            "tool_choice": {"type": "function", "name": "bash"}, "stream": True})
        events = _events(raw)
        assert [name for name, _ in events][:2] == ["response.created", "response.in_progress"]
        name, data = events[-1]
        assert name == "response.failed"
        failed = data["response"]
        assert failed["status"] == "failed"
        assert failed["error"]["code"] == "invalid_prompt"
        assert "grammar" in failed["error"]["message"]
        assert http.get(f"/v1/responses/{failed['id']}").status_code == 404


# Function calls.
def test_a_function_call_is_an_output_item(scripted_server):
    response = scripted_server.client().responses.create(
        model="scripted", input="what is here?", tools=TOOLS, max_output_tokens=200)
    assert response.status == "completed"
    message, call = response.output
    assert message.content[0].text == "Let me look."
    assert call.type == "function_call" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert call.name == "bash"
    assert json.loads(call.arguments) == {"command": "ls -la"}
    assert response.tools[0].name == "bash"


def test_without_tools_the_call_stays_text(scripted_server):
    response = scripted_server.client().responses.create(
        model="scripted", input="what is here?", max_output_tokens=200, store=False)
    (message,) = response.output
    assert '"name": "bash"' in response.output_text and message.type == "message"


def test_function_call_output_continues_the_chain_as_one_job(scripted_server):
    client = scripted_server.client()
    first = client.responses.create(model="scripted", input="what is here?", tools=TOOLS,
                                    max_output_tokens=200, extra_body={"job_id": "lister"})
    call = first.output[-1]
    with _scripted_http(scripted_server) as http:
        pin = http.get("/v1/jobs/lister").json()["pin"]
    assert pin["request_id"] == first.id and pin["ttl_s"] == PIN_TTL_S
    tool_output = "a.txt b.txt c.txt"
    second = client.responses.create(
        model="scripted", previous_response_id=first.id, tools=TOOLS, max_output_tokens=200,
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": tool_output}])
    assert second.previous_response_id == first.id
    assert second.model_extra["job_id"] == "lister"  # the chain's job
    # The second prompt holds the first's input and output, then the tool's output.
    assert second.usage.input_tokens > (first.usage.input_tokens + first.usage.output_tokens
                                        + len(tool_output))
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens // BLOCK_SIZE * BLOCK_SIZE
    with _scripted_http(scripted_server) as http:
        pin = http.get("/v1/jobs/lister").json()["pin"]
    assert pin["request_id"] == second.id  # the second turn's KV, pinned for the same job


def test_a_chain_whose_call_is_not_answered_is_refused(scripted_server):
    client = scripted_server.client()
    first = client.responses.create(model="scripted", input="what is here?", tools=TOOLS,
                                    max_output_tokens=200)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="scripted", previous_response_id=first.id, tools=TOOLS,
                                input="never mind, say hi", max_output_tokens=200)
    assert refused.value.body["param"] == "input"
    assert first.output[-1].call_id in refused.value.body["message"]


def test_the_whole_history_can_be_sent_instead(scripted_server):
    client = scripted_server.client()
    first = client.responses.create(model="scripted", input="what is here?", tools=TOOLS,
                                    max_output_tokens=200, store=False)
    history = [{"role": "user", "content": "what is here?"},
               *[item.model_dump(exclude_none=True) for item in first.output],
               {"type": "function_call_output", "call_id": first.output[-1].call_id,
                "output": [{"type": "input_text", "text": "a.txt"}]}]
    second = client.responses.create(model="scripted", input=history, tools=TOOLS,
                                     max_output_tokens=200, store=False,
                                     extra_body={"job_id": "stateless-job"})
    assert second.status == "completed"
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.model_extra["job_id"] == "stateless-job"
    with _scripted_http(scripted_server) as http:
        assert http.get("/v1/jobs/stateless-job").json()["pin"]["request_id"] == second.id


def test_openai_agents_runs_a_tool_through_the_responses_api(scripted_server):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def bash(command: str) -> str:
        """Run a shell command."""
        calls.append(command)
        return "a.txt"

    async def run() -> str:
        client = openai.AsyncOpenAI(base_url=scripted_server.base_url + "/v1",
                                    api_key="secret-key", max_retries=0)
        agent = agents.Agent(
            name="lister", instructions="List files.", tools=[bash],
            model=agents.OpenAIResponsesModel(model="scripted", openai_client=client),
            tool_use_behavior="stop_on_first_tool",
            model_settings=agents.ModelSettings(max_tokens=200))
        result = await agents.Runner.run(agent, "what is here?", max_turns=2)
        await client.close()
        return result.final_output

    assert asyncio.run(run()) == "a.txt"
    assert calls == ["ls -la"]


def test_langchain_reads_function_calls(scripted_server):
    chat_openai = pytest.importorskip("langchain_openai").ChatOpenAI
    llm = chat_openai(model="scripted", base_url=scripted_server.base_url + "/v1",
                      api_key="secret-key", use_responses_api=True, max_tokens=200,
                      max_retries=0)
    message = llm.bind_tools(TOOLS).invoke("what is here?")
    (call,) = message.tool_calls
    assert (call["name"], call["args"]) == ("bash", {"command": "ls -la"})


# Chains and the store.
def test_previous_response_id_prepends_the_chain_in_one_job(server):
    client = server.client()
    first = client.responses.create(model="tiny", input="The first question, long enough "
                                    "to fill a block or two of the cache.",
                                    max_output_tokens=4, extra_body={**NO_EOS, "job_id": "asker"})
    second = client.responses.create(model="tiny", input="And the second?",
                                     previous_response_id=first.id, max_output_tokens=4,
                                     extra_body=NO_EOS)
    third = client.responses.create(model="tiny", input="A third.",
                                    previous_response_id=second.id, max_output_tokens=4,
                                    extra_body=NO_EOS)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
    for earlier, later in ((first, second), (second, third)):
        assert later.usage.input_tokens_details.cached_tokens >= \
            earlier.usage.input_tokens // BLOCK_SIZE * BLOCK_SIZE
    assert {r.model_extra["job_id"] for r in (first, second, third)} == {"asker"}
    with server.http() as http:
        books = http.get("/v1/jobs/asker").json()["policy"]
    assert books["num_turns_finished"] == 3


def test_an_explicit_job_id_wins_over_the_chain(server):
    client = server.client()
    first = client.responses.create(model="tiny", input="hi", max_output_tokens=2,
                                    extra_body=NO_EOS)
    second = client.responses.create(model="tiny", input="again", max_output_tokens=2,
                                     previous_response_id=first.id,
                                     extra_body={**NO_EOS, "job_id": "named-job"})
    assert second.model_extra["job_id"] == "named-job"
    with server.http() as http:
        assert http.get("/v1/jobs/named-job").json()["policy"]["num_turns_finished"] == 1


def test_retrieve_and_delete_a_stored_response(server):
    client = server.client()
    created = client.responses.create(model="tiny", input="keep me", max_output_tokens=3,
                                      extra_body=NO_EOS)
    retrieved = client.responses.retrieve(created.id)
    assert retrieved.model_dump() == created.model_dump()
    # Streaming is for background responses, which none is: refused, not sent as JSON that
    # the SDK's stream would read as no events.
    with pytest.raises(openai.BadRequestError) as refused:
        list(client.responses.retrieve(created.id, stream=True))
    assert refused.value.body["param"] == "stream"
    with server.http() as http:
        deleted = http.delete(f"/v1/responses/{created.id}")
        assert deleted.json() == {"id": created.id, "object": "response", "deleted": True}
        assert http.get(f"/v1/responses/{created.id}").status_code == 404
        again = http.delete(f"/v1/responses/{created.id}")
    assert again.status_code == 404
    assert again.json()["error"]["code"] == "response_not_found"


def test_input_items_list_what_a_response_continued_and_was_sent(server):
    client = server.client()
    first = client.responses.create(model="tiny", input="first question", max_output_tokens=2,
                                    extra_body=NO_EOS)
    second = client.responses.create(
        model="tiny", previous_response_id=first.id, max_output_tokens=2, extra_body=NO_EOS,
        input=[{"role": "user", "content": "second question", "id": "msg_mine"}])
    listed = client.responses.input_items.list(second.id, order="asc")
    # The first turn's input and output, then this turn's input (its own id kept).
    assert [item.type for item in listed.data] == ["message", "message", "message"]
    assert [item.role for item in listed.data] == ["user", "assistant", "user"]
    assert listed.data[0].content[0].text == "first question"
    assert listed.data[-1].id == "msg_mine" and listed.data[-1].content[0].text == (
        "second question")
    assert len({item.id for item in listed.data}) == 3 and not listed.has_more
    newest_first = client.responses.input_items.list(second.id, limit=2)
    assert [item.id for item in newest_first.data] == [listed.data[2].id, listed.data[1].id]
    assert newest_first.has_more and newest_first.last_id == listed.data[1].id
    rest = client.responses.input_items.list(second.id, after=newest_first.last_id)
    assert [item.id for item in rest.data] == [listed.data[0].id] and not rest.has_more
    first_listed = client.responses.input_items.list(first.id).data
    assert first_listed[0].content[0].text == "first question"
    # An item keeps its id under every response of the chain that lists it.
    assert first_listed[0].id == listed.data[0].id and first_listed[0].id.startswith("msg_")
    with server.http() as http:
        for query, param in (("limit=0", "limit"), ("order=sideways", "order"),
                             ("after=msg_nowhere", "after")):
            bad = http.get(f"/v1/responses/{second.id}/input_items?{query}")
            assert (bad.status_code, bad.json()["error"]["param"]) == (400, param)
        missing = http.get("/v1/responses/resp_never/input_items")
        assert missing.json()["error"]["code"] == "response_not_found"


def test_cancel_refuses_a_finished_response_as_openai_does_for_foreground_ones(server):
    client = server.client()
    created = client.responses.create(model="tiny", input="done", max_output_tokens=2,
                                      extra_body=NO_EOS)
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.cancel(created.id)
    assert client.responses.retrieve(created.id).status == "incomplete"  # unchanged
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_never")


def test_store_false_is_not_kept(server):
    client = server.client()
    response = client.responses.create(model="tiny", input="forget me", max_output_tokens=2,
                                       store=False, extra_body=NO_EOS)
    assert response.model_extra["store"] is False
    assert response.model_extra["job_id"] is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model="tiny", input="next", previous_response_id=response.id)
    assert error.value.body["code"] == "previous_response_not_found"
    assert error.value.body["param"] == "previous_response_id"


KEYS = {"alpha": "key-a", "beta": "key-b"}
MAX_STORED = 3  # a tenant


@pytest.fixture(scope="module")
def small_store_server() -> Iterator[ServerThread]:
    """Two tenants, and a store of at most `MAX_STORED` responses for each."""
    tenants = Tenants.from_pairs([(key, name) for name, key in KEYS.items()])
    running = start_server(settings=ServerSettings(
        served_model_name="tiny", tenants=tenants, max_stored_responses=2 * MAX_STORED),
        api_key=KEYS["alpha"])
    yield running
    running.stop()


def _create(server: ServerThread, tenant: str, **fields: object) -> httpx.Response:
    with server.http(headers={"Authorization": f"Bearer {KEYS[tenant]}"}) as http:
        return http.post("/v1/responses", json={
            "model": "tiny", "input": "hello", "max_output_tokens": 2, "ignore_eos": True,
            **fields})


def test_the_store_evicts_the_least_recently_used(small_store_server):
    ids = [_create(small_store_server, "alpha").json()["id"] for _ in range(MAX_STORED)]
    with small_store_server.http(headers={"Authorization": "Bearer key-a"}) as http:
        assert http.get(f"/v1/responses/{ids[0]}").status_code == 200  # now the most recent
        newest = _create(small_store_server, "alpha").json()["id"]
        found = {id_: http.get(f"/v1/responses/{id_}").status_code
                 for id_ in [*ids, newest]}
    assert found == {ids[0]: 200, ids[1]: 404, ids[2]: 200, newest: 200}
    evicted = _create(small_store_server, "alpha", previous_response_id=ids[1])
    assert evicted.status_code == 400
    assert evicted.json()["error"]["code"] == "previous_response_not_found"


def test_another_tenants_flood_evicts_none_of_a_tenants_responses(small_store_server):
    kept = _create(small_store_server, "alpha").json()["id"]
    for _ in range(2 * MAX_STORED):
        assert _create(small_store_server, "beta").status_code == 200
    with small_store_server.http(headers={"Authorization": "Bearer key-a"}) as http:
        assert http.get(f"/v1/responses/{kept}").status_code == 200


def test_a_tenant_never_reads_another_tenants_response(small_store_server):
    response_id = _create(small_store_server, "alpha", job_id="alpha-job").json()["id"]
    with small_store_server.http(headers={"Authorization": "Bearer key-b"}) as beta:
        assert beta.get(f"/v1/responses/{response_id}").status_code == 404
        assert beta.get(f"/v1/responses/{response_id}/input_items").status_code == 404
        assert beta.post(f"/v1/responses/{response_id}/cancel").status_code == 404
        assert beta.delete(f"/v1/responses/{response_id}").status_code == 404
        assert beta.get("/v1/jobs/alpha-job").status_code == 404
    continued = _create(small_store_server, "beta", previous_response_id=response_id)
    assert continued.status_code == 400
    assert continued.json()["error"]["code"] == "previous_response_not_found"
    with small_store_server.http(headers={"Authorization": "Bearer key-a"}) as alpha:
        assert alpha.get(f"/v1/responses/{response_id}").status_code == 200
        assert alpha.get("/v1/jobs/alpha-job").status_code == 200


# Bad input.
BAD_BODIES = [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input.0"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
    ({"input": 7}, "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": "hi", "tool_choice": {"type": "function", "name": "python"}, "tools": TOOLS},
     "tool_choice"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "tools": [*TOOLS, *TOOLS]}, "tools"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                         "schema": {"type": "bogus"}}}}, "text.format.schema"),
    ({"input": "hi", "include": ["file_search_call.results"]}, "include"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "truncation": "auto"}, "truncation"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation"),
    ({"input": "hi", "n": 2}, "n"),
    ({"input": "hi", "stop": ["x"]}, "stop"),  # chat's fields are not the Responses API's
    ({"input": "hi", "text": {"format": {"type": "text"}}, "tools": [  # strict by default
        {"type": "function", "name": "f",
         "parameters": {"type": "object", "additionalProperties": True}}]},
     "tools[0].parameters"),
    ({"input": "hi", "max_output_tokens": 5000}, "max_output_tokens"),
    ({"input": "hi", "metadata": {"k": "v" * 600}}, "metadata.k"),
    ({"input": "hi", "previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "x"}]},
     "input"),
    ({"input": "hi", "model": "gpt-4o"}, "model"),
    ({"input": []}, "input"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_BODIES,
                         ids=[param for _, param in BAD_BODIES])
def test_bad_input_is_a_400_naming_the_field(server, fields, param):
    before = server.stats()
    with server.http() as http:
        response = http.post("/v1/responses", json={"model": "tiny", **fields})
    expected_status = 404 if param == "model" else 400
    assert response.status_code == expected_status, response.text
    assert response.json()["error"]["param"] == param
    assert "messages" not in response.json()["error"]["message"]  # chat's name for it
    after = server.stats()
    assert after.num_waiting == before.num_waiting == 0


def test_nulls_mean_defaults(server):
    with server.http() as http:
        response = http.post("/v1/responses", json={
            "model": "tiny", "input": "hi", "max_output_tokens": 2, "ignore_eos": True,
            "instructions": None, "temperature": None, "top_p": None, "tools": None,
            "tool_choice": None, "text": None, "store": None, "metadata": None,
            "reasoning": None, "include": None, "previous_response_id": None, "user": None,
            "parallel_tool_calls": None, "truncation": None, "stream": None})
    assert response.status_code == 200, response.text
    assert response.json()["store"] is True


def test_a_closed_stream_aborts_and_frees_the_engine(server):
    with server.http() as http, http.stream("POST", "/v1/responses", json={
            "model": "tiny", "input": "go on", "max_output_tokens": 500, "stream": True,
            "ignore_eos": True, "store": False}) as response:
        for line in response.iter_lines():
            if "output_text.delta" in line:
                break
    stats = server.wait_idle()
    assert stats.num_free_blocks + stats.num_pinned_blocks == stats.num_kv_blocks


# The pieces, without a server.
def _stored(response_id: str, num_text_bytes: int) -> StoredResponse:
    """A response that the store charges `num_text_bytes` plus its overhead."""
    body = {"id": response_id, "pad": ""}
    body["pad"] = "x" * (num_text_bytes - len(json.dumps(body, separators=(",", ":"))))
    stored = StoredResponse.of(response_id, None, (),
                               json.dumps(body, separators=(",", ":")).encode(),
                               num_input_items=0)
    assert stored.num_bytes == num_text_bytes + ENTRY_OVERHEAD_BYTES
    return stored


def test_the_store_is_bounded_by_bytes_in_each_tenants_quota():
    store = ResponseStore(max_responses=10, max_bytes=2 * 2000, num_tenants=2)
    assert store.max_bytes_per_tenant == 2000  # two responses of 400 text bytes and overhead
    assert store.put("a", _stored("r1", 400)) and store.put("a", _stored("r2", 400))
    assert store.get("b", "r1") is None  # another tenant's
    assert store.get("a", "r1") is not None  # r1 is now the most recently used
    assert store.put("a", _stored("r3", 400))
    assert [store.get("a", r) is not None for r in ("r1", "r2", "r3")] == [True, False, True]
    assert not store.put("a", _stored("huge", 2000))
    assert store.delete("a", "r3") and not store.delete("a", "r3")
    assert (len(store), store.num_bytes) == (1, 400 + ENTRY_OVERHEAD_BYTES)


def test_one_tenants_writes_never_evict_another_tenants_responses():
    store = ResponseStore(max_responses=4, max_bytes=10**6, num_tenants=2)
    assert store.put("a", _stored("kept", 100))
    for index in range(100):  # b floods the store
        assert store.put("b", _stored(f"flood{index}", 100))
    assert store.get("a", "kept") is not None
    assert len(store) == 1 + store.max_responses_per_tenant == 3


def test_the_bytes_charged_are_the_bytes_held():
    items = ResponsesRequest.model_validate({"input": [
        {"role": "user" if index % 2 else "assistant", "content": f"message {index} " * 20}
        for index in range(2000)]}).input
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    stored = StoredResponse.of("resp_1", None, [item_json(item) for item in items],
                               b'{"id":"resp_1"}', num_input_items=2000)
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert held <= stored.num_bytes
    assert stored.items() == list(items) and stored.body() == {"id": "resp_1"}
    assert stored.items(1, 3) == list(items[1:3])


def test_a_store_without_room_for_every_tenant_is_refused():
    with pytest.raises(ValueError, match="at least one response of each of the 2 tenants"):
        ResponseStore(max_responses=1, max_bytes=10**6, num_tenants=2)
    tenants = Tenants.from_pairs([(key, name) for name, key in KEYS.items()])
    with pytest.raises(ValueError, match="at least one response of each of the 2 tenants"):
        ServerSettings(served_model_name="tiny", tenants=tenants, max_stored_responses=1)


def _messages(items, instructions=None):
    return template_messages(instructions, ResponsesRequest.model_validate(
        {"input": items}).input)


def test_items_become_chat_messages_with_tool_calls():
    messages = _messages([
        {"role": "user", "content": [{"type": "input_text", "text": "list"},
                                     {"type": "input_text", "text": " files"}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Sure."}]},
        {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": '{"a": 1}'},
        {"type": "function_call", "call_id": "c2", "name": "pwd", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "x"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "/"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c3", "name": "ls", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c3", "output": "y"},
    ], instructions="Be brief.")
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool",
                                             "assistant", "tool"]
    assert messages[0]["content"] == "Be brief."
    assert messages[1]["content"] == "list files"
    assistant = messages[2]
    assert assistant["content"] == "Sure."
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"])
            for c in assistant["tool_calls"]] == [("c1", "ls", {"a": 1}), ("c2", "pwd", {})]
    assert [(m["tool_call_id"], m["name"], m["content"]) for m in messages[3:5]] == [
        ("c1", "ls", "x"), ("c2", "pwd", "/")]
    assert messages[5]["content"] == "" and messages[5]["tool_calls"][0]["id"] == "c3"


def test_a_call_without_its_output_is_rejected():
    """As OpenAI refuses it, whether the call is in the input or the stored chain's."""
    with pytest.raises(APIError) as error:
        _messages([{"role": "user", "content": "list"},
                   {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{}"},
                   {"role": "user", "content": "never mind"}])
    assert (error.value.param, str(error.value.message)) == (
        "input", "No tool output found for function call c1.")


def test_an_output_without_its_call_is_rejected():
    with pytest.raises(APIError) as error:
        _messages([{"type": "function_call_output", "call_id": "nope", "output": "x"}])
    assert error.value.param == "input"
