"""A tool call cut off by the token limit or a stop string, on every API that parses calls:
the scripted executor writes `SCRIPT` (text, then a Hermes call of `bash`), and a small
`max_tokens` ends it inside the call. The call's markup is never text; the call shows as the
last call, its arguments as far as written, and the stop reason says why the output ended.
A stop string at the start leaves an output of nothing; an output of whitespace has no text
block either, as Anthropic refuses a blank one sent back."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import pytest

from engine.entrypoints.openai.serving import ServerSettings
from engine.entrypoints.openai.tenants import Tenants
from tests.engine.entrypoints.openai.conftest import SCRIPTED, ServerThread, start_server

ARGUMENTS = '{"command": "ls -la"}'
CHAT_TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "run a command",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}]
RESPONSES_TOOLS = [{"type": "function", **CHAT_TOOLS[0]["function"]}]
MESSAGES_TOOLS = [{"name": "bash", "description": "run a command",
                   "input_schema": CHAT_TOOLS[0]["function"]["parameters"]}]
MESSAGES = [{"role": "user", "content": "what is here?"}]


@pytest.fixture(scope="module")
def cut_max_tokens(scripted_server: ServerThread) -> int:
    """A `max_tokens` that ends the script inside the call's arguments; every smaller one
    checked on the way: no markup as content, the call cut where the text was."""
    client = scripted_server.client()
    for max_tokens in range(1, 64):
        choice = client.chat.completions.create(
            model="scripted", messages=MESSAGES, tools=CHAT_TOOLS,
            max_tokens=max_tokens).choices[0]
        assert choice.finish_reason == "length"
        assert "<tool_call>" not in (choice.message.content or "")
        if choice.message.tool_calls is None:
            continue
        (call,) = choice.message.tool_calls
        assert choice.message.content == "Let me look."
        assert call.function.name == "bash" and call.id.startswith("call_")
        assert ARGUMENTS.startswith(call.function.arguments)
        if call.function.arguments:
            return max_tokens
    raise AssertionError("no max_tokens ended the script inside the call's arguments")


def test_a_streamed_chat_cut_call_adds_up_to_the_whole(scripted_server, cut_max_tokens):
    client = scripted_server.client()
    kwargs = {"model": "scripted", "messages": MESSAGES, "tools": CHAT_TOOLS,
              "max_tokens": cut_max_tokens}
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    deltas = [chunk.choices[0].delta for chunk in chunks]
    assert "".join(delta.content or "" for delta in deltas) == whole.message.content
    (call,) = [call for delta in deltas for call in delta.tool_calls or ()]
    assert call.id.startswith("call_")
    assert (call.function.name, call.function.arguments) == (
        "bash", whole.message.tool_calls[0].function.arguments)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_a_cut_call_is_an_incomplete_function_call_item(scripted_server, cut_max_tokens):
    client = scripted_server.client()
    kwargs = {"model": "scripted", "input": "what is here?", "tools": RESPONSES_TOOLS,
              "max_output_tokens": cut_max_tokens}
    whole = client.responses.create(**kwargs)
    assert (whole.status, whole.incomplete_details.reason) == ("incomplete",
                                                              "max_output_tokens")
    message, call = whole.output
    assert message.content[0].text == "Let me look."
    assert (call.type, call.status, call.name) == ("function_call", "incomplete", "bash")
    assert call.arguments and ARGUMENTS.startswith(call.arguments)
    events = list(client.responses.create(stream=True, **kwargs))
    streamed = events[-1].response
    assert events[-1].type == "response.incomplete"
    assert "<tool_call>" not in "".join(
        event.delta for event in events if event.type == "response.output_text.delta")
    assert [(item.type, item.status) for item in streamed.output] == [
        ("message", "incomplete"), ("function_call", "incomplete")]
    assert streamed.output[1].arguments == call.arguments
    # A cut call needs no output: the chain goes on without one.
    again = client.responses.create(model="scripted", previous_response_id=whole.id,
                                    input="try again", tools=RESPONSES_TOOLS,
                                    max_output_tokens=200)
    assert again.status == "completed" and again.output[-1].status == "completed"


def _anthropic(server: ServerThread) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=server.api_key,
                               max_retries=0, timeout=60)


def test_a_cut_call_is_the_last_tool_use_block(scripted_server, cut_max_tokens):
    """As Anthropic documents: `max_tokens` with an incomplete `tool_use` last, whole or
    streamed (the SDK reads the streamed input as partial JSON)."""
    client = _anthropic(scripted_server)
    kwargs = {"model": "scripted", "messages": MESSAGES, "tools": MESSAGES_TOOLS,
              "max_tokens": cut_max_tokens}
    whole = client.messages.create(**kwargs)
    assert whole.stop_reason == "max_tokens"
    text, tool_use = whole.content
    assert text.text == "Let me look."
    assert (tool_use.type, tool_use.name) == ("tool_use", "bash")
    assert isinstance(tool_use.input, dict)
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "max_tokens"
    assert [block.type for block in final.content] == ["text", "tool_use"]
    assert final.content[1].name == "bash"


def test_a_stop_sequence_in_a_call_ends_it_without_its_markup(scripted_server):
    client = _anthropic(scripted_server)
    message = client.messages.create(model="scripted", messages=MESSAGES, max_tokens=200,
                                     tools=MESSAGES_TOOLS, stop_sequences=["ls"])
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "ls")
    text, tool_use = message.content
    assert text.text == "Let me look."
    assert tool_use.name == "bash" and tool_use.input == {}
    assert "<tool_call>" not in json.dumps(message.model_dump())


def test_an_empty_output_has_no_content_block(scripted_server):
    """As Anthropic's: `content` is empty, and a stream opens no block."""
    client = _anthropic(scripted_server)
    kwargs = {"model": "scripted", "messages": MESSAGES, "max_tokens": 200,
              "stop_sequences": ["Let"]}
    message = client.messages.create(**kwargs)
    assert (message.content, message.stop_reason) == ([], "stop_sequence")
    with client.messages.stream(**kwargs) as stream:
        names = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content == [] and final.stop_reason == "stop_sequence"
    assert names == ["message_start", "message_delta", "message_stop"]


@pytest.fixture(scope="module")
def blank_server() -> Iterator[ServerThread]:
    running = start_server(
        executor=f"{SCRIPTED}:BlankThenCallExecutor", api_key="secret-key",
        settings=ServerSettings(served_model_name="scripted",
                                tenants=Tenants.from_pairs([("secret-key", "default")])))
    yield running
    running.stop()


@pytest.mark.parametrize(("fields", "content_types"), [
    ({"tools": MESSAGES_TOOLS}, ["tool_use"]),  # the blank before the call
    ({"stop_sequences": ["{"]}, []),  # the blank alone (the markup a special token)
])
def test_an_output_of_whitespace_has_no_text_block(blank_server, fields, content_types):
    client = _anthropic(blank_server)
    kwargs = {"model": "scripted", "messages": MESSAGES, "max_tokens": 200, **fields}
    message = client.messages.create(**kwargs)
    assert [block.type for block in message.content] == content_types
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [block.type for block in final.content] == content_types
    # Sent back, the answer is a conversation Anthropic (and this server) takes.
    if content_types:
        (call,) = message.content
        client.messages.create(model="scripted", max_tokens=4, tools=MESSAGES_TOOLS, messages=[
            *MESSAGES, {"role": "assistant", "content": [call.model_dump()]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                          "content": "."}]}])
