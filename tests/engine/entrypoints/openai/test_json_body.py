"""Large bodies are parsed, checked against the body limits and validated as the route's
model in a child process, which also makes a chat's prompt: what is over a limit never comes
back into the server's process, and what was validated there, whether it passed or not, is
not validated again."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool

import pytest
from fastapi import Body, Depends, FastAPI, Request
from fastapi.testclient import TestClient
from pydantic import BaseModel, model_validator

from engine.entrypoints.openai import serving_chat, serving_messages
from engine.entrypoints.openai.body_limits import MAX_CONVERSATION_PARTS, BodyLimitError
from engine.entrypoints.openai.chat_prompt import ChatPrompt, render_chat_prompt
from engine.entrypoints.openai.json_body import (
    CHILD_PROMPTS,
    INLINE_PARSE_BYTES,
    INLINE_PARSE_TOOLS,
    OFF_LOOP_JOIN_BYTES,
    BodyParser,
    ChildAnswerTimeout,
    ChildPrompt,
    ParsedBody,
    PoolParsedRequest,
    PoolParsedRoute,
    parsed_off_loop,
)
from engine.entrypoints.openai.messages_prompt import count_prompt
from engine.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from engine.entrypoints.openai.protocol_messages import MessagesCountTokensRequest
from engine.entrypoints.openai.protocol_responses import ResponsesRequest
from engine.entrypoints.openai.serving import ClientContext, ServerSettings
from engine.entrypoints.openai.tool_call_ids import issued_call_id
from engine.entrypoints.openai.work_pool import (
    BACKGROUND_NICENESS,
    TenantWorkPool,
    lower_thread_priority,
)
from engine.entrypoints.server_args import add_arguments, server_settings_from_args
from engine.frontend.processor import InputProcessor
from engine.model.tokenizer import load_tokenizer

CHAT_PROMPT = CHILD_PROMPTS["/v1/chat/completions"]
COUNT_PROMPT = CHILD_PROMPTS["/v1/messages/count_tokens"]


@pytest.fixture(scope="module")
def parser():
    running = BodyParser(num_processes=1)
    yield running
    running.shutdown()


@pytest.fixture(scope="module")
def processor() -> InputProcessor:
    """The tiny model's input processor, with a context of 64 tokens."""
    return InputProcessor(load_tokenizer("tiny"), vocab_size=512, max_model_len=64)


@pytest.fixture(scope="module")
def preparing_parser(processor):
    running = BodyParser(num_processes=1, processor=processor)
    yield running
    running.shutdown()


def pool_parsed_app(parser: BodyParser) -> FastAPI:
    """An app whose routes parse large bodies with `parser`, on a work pool of two threads
    (the caller shuts the pool down)."""
    app = FastAPI()
    app.router.route_class = PoolParsedRoute
    app.state.work_pool, app.state.body_parser = TenantWorkPool(2), parser
    return app


def test_parses_in_a_child_process_as_json_loads_does(parser):
    body = '{"a": [1, 2.5, true, null], "b": "d\\u00e9 \\ud800"}'.encode("utf-16")
    assert parser.parse(body, None).value == json.loads(body)
    with pytest.raises(json.JSONDecodeError):
        parser.parse(b'{"a": 1', None)


def _pid_and_length(body: bytes) -> tuple[int, int]:
    return os.getpid(), len(body)


def test_a_summary_is_made_in_a_child_and_only_it_comes_back(parser):
    """`BodyParser.summary`: the caller's function of a body, run in a child (the Ray
    ingress reads a large body's route so), on a pool replaced when a child died idle."""
    pid, length = parser.summary(b"x" * 100, _pid_and_length)
    assert pid != os.getpid() and length == 100
    executor = parser._live_executor()
    for child in list(executor._processes):
        os.kill(child, 9)
    deadline_s = time.monotonic() + 60
    while not executor._broken:
        assert time.monotonic() < deadline_s
        time.sleep(0.01)
    assert parser.summary(b"yz", _pid_and_length)[1] == 2


def _length_after_a_while(body: bytes) -> int:
    time.sleep(3.0)
    return len(body)


def test_a_child_that_does_not_answer_in_time_is_a_timeout_not_a_wait_forever():
    """A caller (a work-pool thread) waits at most `answer_timeout_s` for a child, so that an
    answer CPython loses when a pool breaks under a submit cannot hold it forever; the pool
    itself is kept, and answers the next body."""
    slow = BodyParser(num_processes=1)
    try:
        assert slow.summary(b"warm", len) == 4  # the child is up: only the wait counts now
        slow.answer_timeout_s = 0.5
        with pytest.raises(ChildAnswerTimeout, match=r"within 0\.5 s"):
            slow.summary(b"late", _length_after_a_while)
        slow.answer_timeout_s = 30.0
        assert slow.parse(b"[2]", None).value == [2]  # queued behind the late one
    finally:
        slow.shutdown()
    with pytest.raises(ValueError, match="answer_timeout_s"):
        BodyParser(answer_timeout_s=0)


def test_a_body_over_a_limit_is_refused_in_the_child(parser):
    body = json.dumps({"messages": [{"content": [{}] * (MAX_CONVERSATION_PARTS + 1)}]})
    with pytest.raises(BodyLimitError) as refused:
        parser.parse(body.encode(), "messages")
    assert refused.value.param == "messages"
    assert parser.parse(body.encode(), "input").value["messages"]


def test_a_dead_child_is_replaced(parser):
    parser.parse(b"[]", None)
    executor = parser._live_executor()
    for pid in list(executor._processes):
        os.kill(pid, 9)
    assert parser.parse(b"[1]", None).value == [1]


def test_large_chat_bodies_are_served_or_refused_with_400(server):
    filler = "word " * (INLINE_PARSE_BYTES // 4)
    body = {"model": "tiny", "max_tokens": 2, "messages": [
        {"role": "system", "content": "x", "metadata": filler},
        {"role": "user", "content": "hello"}]}
    over = {"model": "tiny", "messages": [
        {"role": "user", "content": [{"type": "text"}] * (MAX_CONVERSATION_PARTS + 1)}]}
    assert len(json.dumps(over)) > INLINE_PARSE_BYTES
    with server.http() as http:
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        broken = http.post("/v1/chat/completions", content=json.dumps(body)[:-1].encode(),
                           headers={"Content-Type": "application/json"})
        refused = http.post("/v1/chat/completions", json=over)
    assert broken.status_code == 400
    assert "JSON" in broken.json()["error"]["message"]
    assert refused.status_code == 400
    assert (refused.json()["error"]["param"], refused.json()["error"]["code"]) == (
        "messages", "limit_exceeded")


def test_refused_large_bodies_are_freed_with_their_requests_without_the_cyclic_gc(server):
    """A large body refused by its parse in the child is freed once its request has ended,
    by reference counting alone: nothing ties it into a cycle (one through the work pool's
    future kept 1.3 GB of a hostile tenant's refused bodies alive in 90 s)."""
    over = {"model": "tiny", "messages": [
        {"role": "user", "content": [{"type": "text"}] * (MAX_CONVERSATION_PARTS + 1)}]}
    gc.collect()
    gc.disable()
    try:
        with server.http() as http:
            for _ in range(3):
                assert http.post("/v1/chat/completions", json=over).status_code == 400
        deadline_s = time.monotonic() + 10
        while _requests_holding_large_bodies():
            assert time.monotonic() < deadline_s, "refused bodies outlived their requests"
            time.sleep(0.01)
    finally:
        gc.enable()


def _requests_holding_large_bodies() -> int:
    return sum(1 for obj in gc.get_objects() if isinstance(obj, PoolParsedRequest)
               and len(getattr(obj, "_body", b"")) > INLINE_PARSE_BYTES)


def test_a_large_bodys_preparation_runs_in_the_background(parser):
    """`ClientContext.large_body` (what sends a request's preparation to the work pool's
    low-priority threads) is set by a body parsed off the loop, not by an inline one."""
    app = pool_parsed_app(parser)

    @app.post("/v1/chat/completions")
    async def echo(body: dict, request: Request) -> dict:
        return {"large_body": ClientContext.of(request).large_body}

    with TestClient(app) as client:
        small = client.post("/v1/chat/completions", json={"messages": []}).json()
        large = client.post("/v1/chat/completions",
                            json={"messages": ["x" * INLINE_PARSE_BYTES]}).json()
    assert (small, large) == ({"large_body": False}, {"large_body": True})
    app.state.work_pool.shutdown()


async def _body_read_in_pieces(app: FastAPI, pieces: list[bytes]) -> bytes:
    """`PoolParsedRequest.body` of a request of `app` whose body arrives as `pieces`."""
    messages = [{"type": "http.request", "body": piece, "more_body": True} for piece in pieces]
    messages.append({"type": "http.request", "body": b"", "more_body": False})

    async def receive() -> dict:
        return messages.pop(0)

    scope = {"type": "http", "method": "POST", "path": "/", "headers": [],
             "query_string": b"", "app": app}
    return await PoolParsedRequest(scope, receive).body()


def test_a_body_of_a_mebibyte_in_pieces_is_joined_off_the_event_loop(parser, monkeypatch):
    """Starlette joins a body's chunks on the event loop (8 MB held it about 8 ms under `bench
    bodies --attack chats`): from `OFF_LOOP_JOIN_BYTES` up they are joined by the parser's
    joining thread, into the same bytes; a smaller body's where it is read; a body that came
    in one piece is that piece."""
    app = FastAPI()
    app.state.body_parser = parser
    joined: list[int] = []
    join = parser.join

    def recording_join(chunks: list[bytes]) -> Future[bytes]:
        joined.append(sum(map(len, chunks)))
        return join(chunks)

    monkeypatch.setattr(parser, "join", recording_join)
    large, small = os.urandom(OFF_LOOP_JOIN_BYTES), os.urandom(OFF_LOOP_JOIN_BYTES - 1)
    assert asyncio.run(_body_read_in_pieces(app, [large[:7], large[7:]])) == large
    assert joined == [len(large)]
    assert asyncio.run(_body_read_in_pieces(app, [small[:7], small[7:]])) == small
    assert asyncio.run(_body_read_in_pieces(app, [large])) is large
    assert joined == [len(large)]


class WhereValidated(BaseModel):
    """A body that records the process that validated it."""

    text: str
    validated_in_pid: int = 0

    @model_validator(mode="before")
    @classmethod
    def _record_pid(cls, data: dict) -> dict:
        return {**data, "validated_in_pid": os.getpid()}


# Validations of `CountedInvalid` in this process (the child's are in the child's).
VALIDATED_HERE: list[int] = []


class CountedInvalid(BaseModel):
    """A body that counts its validations in this process."""

    text: str
    number: int

    @model_validator(mode="before")
    @classmethod
    def _count(cls, data: dict) -> dict:
        VALIDATED_HERE.append(os.getpid())
        return data


def test_a_large_invalid_body_is_not_validated_again_by_the_route(parser):
    app = pool_parsed_app(parser)

    @app.post("/echo")
    async def echo(body: CountedInvalid) -> dict:
        return {"number": body.number}

    VALIDATED_HERE.clear()
    with TestClient(app) as client:
        small = client.post("/echo", json={"text": "x", "number": "many"})
        validated_small = list(VALIDATED_HERE)
        large = client.post("/echo", json={"text": "x" * INLINE_PARSE_BYTES, "number": "many"})
    app.state.work_pool.shutdown()
    assert validated_small == [os.getpid()] and small.status_code == 422
    assert len(VALIDATED_HERE) == 1  # the large one was validated in the child only
    assert large.status_code == 400
    assert large.json()["detail"].startswith("number: ")


def test_a_large_body_is_validated_in_the_child_and_not_again(parser):
    app = pool_parsed_app(parser)

    @app.post("/echo")
    async def echo(body: WhereValidated) -> dict:
        return {"pid": body.validated_in_pid, "length": len(body.text)}

    with TestClient(app) as client:
        small = client.post("/echo", json={"text": "x"}).json()
        large = client.post("/echo", json={"text": "x" * INLINE_PARSE_BYTES}).json()
    assert small == {"pid": os.getpid(), "length": 1}
    assert large["length"] == INLINE_PARSE_BYTES
    assert large["pid"] not in (0, os.getpid())  # a child's, and kept by the route
    app.state.work_pool.shutdown()


@pytest.mark.parametrize(("model", "body"), [
    (CompletionRequest, {"model": "tiny", "prompt": [1, 2, 3], "logit_bias": {"5": 1.0}}),
    (ChatCompletionRequest, {"model": "tiny", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "response_format": {"type": "json_object"}}),
    (ResponsesRequest, {"model": "tiny", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "function_call_output", "call_id": "c", "output": "ok"}],
        "text": {"format": {"type": "json_schema", "name": "s", "schema": {}}}}),
], ids=["completion", "chat", "responses"])
def test_every_routes_model_comes_back_from_the_child_as_validated(parser, model, body):
    assert parser.parse(json.dumps(body).encode(), None, model).value == model.model_validate(body)


def _body_x(x: int = Body()) -> int:
    return x


def test_a_body_with_a_dependencys_field_is_left_to_the_route(parser):
    """A body that FastAPI reads as named fields (here one of them a dependency's) is not the
    route's model: the child only parses it."""
    app = pool_parsed_app(parser)

    @app.post("/echo")
    async def echo(body: WhereValidated, x: int = Depends(_body_x)) -> dict:
        return {"length": len(body.text), "x": x}

    with TestClient(app) as client:
        answers = [client.post("/echo", json={"body": {"text": "y" * length}, "x": 1,
                                              "text": "a top-level look-alike"})
                   for length in (1, INLINE_PARSE_BYTES)]
    assert [answer.json() for answer in answers] == [
        {"length": 1, "x": 1}, {"length": INLINE_PARSE_BYTES, "x": 1}]
    app.state.work_pool.shutdown()


def test_the_child_returns_the_model_or_what_it_parsed(parser):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi " * 100}]}
    validated = parser.parse(json.dumps(chat).encode(), "messages", ChatCompletionRequest).value
    assert validated == ChatCompletionRequest.model_validate(chat)
    invalid = {**chat, "max_tokens": "many"}
    refused = parser.parse(json.dumps(invalid).encode(), "messages", ChatCompletionRequest)
    assert refused.value is None
    assert (refused.refusal.status, refused.refusal.param) == (400, "max_tokens")


@pytest.mark.parametrize("bad", [
    {"max_tokens": "many"},
    {"user": "\ud800"},
    {"temperature": -1, "top_p": 7},
], ids=["wrong-type", "lone-surrogate", "two-errors"])
def test_a_large_invalid_body_gets_the_small_ones_error(server, bad):
    """A body that fails validation in the child gets, from the child's error, the answer
    the same body gets inline."""
    small = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **bad}
    large = {**small, "messages": [{"role": "user", "content": "hi"}] * 4
             + [{"role": "user", "content": "x" * INLINE_PARSE_BYTES}]}
    with server.http() as http:
        answers = [http.post("/v1/chat/completions", content=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json"})
                   for body in (small, large)]
    assert [answer.status_code for answer in answers] == [400, 400]
    errors = [answer.json()["error"] for answer in answers]
    assert errors[0]["param"] == next(iter(bad))
    assert errors[0] == errors[1]


def _chat(**fields: object) -> dict:
    return {"model": "tiny", "messages": [
        {"role": "user", "content": "what is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], **fields}


@pytest.mark.parametrize("fields", [
    {},
    {"tools": [{"type": "function", "function": {"name": "weather", "parameters": {}}}]},
    {"messages": [{"role": "user", "content": "many words " * 40}]},
    {"add_generation_prompt": False},
], ids=["conversation", "tools", "too-long", "no-generation-prompt"])
def test_the_child_makes_a_chats_prompt_as_the_server_would(preparing_parser, processor,
                                                           fields):
    body = _chat(**fields)
    parsed = preparing_parser.parse(json.dumps(body).encode(), "messages",
                                    ChatCompletionRequest, CHAT_PROMPT)
    validated = ChatCompletionRequest.model_validate(body)
    assert parsed.value.messages == []
    assert parsed.value.model_copy(update={"messages": validated.messages}) == validated
    assert parsed.chat_prompt == render_chat_prompt(processor, validated)
    assert isinstance(parsed.chat_prompt, ChatPrompt)
    if "messages" in fields:
        assert parsed.chat_prompt.token_ids is None and parsed.chat_prompt.num_tokens > 64


def test_the_childs_prompt_names_the_request_whose_tool_call_it_answers(preparing_parser):
    body = _chat()
    body["messages"][1]["tool_calls"][0]["id"] = issued_call_id("chatcmpl-earlier", 0)
    body["messages"][2]["tool_call_id"] = issued_call_id("chatcmpl-earlier", 0)
    parsed = preparing_parser.parse(json.dumps(body).encode(), "messages",
                                    ChatCompletionRequest, CHAT_PROMPT)
    assert parsed.chat_prompt.continues_request_id == "chatcmpl-earlier"


def test_the_child_does_not_render_what_the_server_refuses(preparing_parser, parser):
    """A chat whose fields the server refuses (here one that would replace the chat
    template) is not rendered in the child; nor is anything by a parser without a
    processor, nor a body that does not validate."""
    replacing = _chat(chat_template_kwargs={"chat_template": "{{ 1 }}"})
    invalid = _chat(max_tokens="many")
    for parsing, body in ((preparing_parser, replacing), (preparing_parser, invalid),
                          (parser, _chat())):
        parsed = parsing.parse(json.dumps(body).encode(), "messages", ChatCompletionRequest,
                               CHAT_PROMPT)
        assert parsed.chat_prompt is None


def test_a_large_chat_is_answered_as_the_same_chat_inline(server, monkeypatch):
    """The same chat sent small (its prompt made on the server's threads) and padded with
    whitespace past `INLINE_PARSE_BYTES` (made in the parsing child, not by the route): the
    same prompt, the same greedy completion, and the same context-length error when too
    long."""
    chat = _chat(max_tokens=4, temperature=0.0)
    too_long = {"model": "tiny", "messages": [{"role": "user", "content": "word " * 1100}]}
    rendered_by_the_route: list[int] = []

    def counted(processor: InputProcessor, body: ChatCompletionRequest) -> ChatPrompt:
        rendered_by_the_route.append(len(body.messages))
        return render_chat_prompt(processor, body)

    monkeypatch.setattr(serving_chat, "render_chat_prompt", counted)
    answers = []
    with server.http() as http:
        for body in (chat, too_long):
            compact = json.dumps(body)
            padded = compact[:-1] + " " * INLINE_PARSE_BYTES + "}"
            answers.append([http.post("/v1/chat/completions", content=text.encode(),
                                      headers={"Content-Type": "application/json"})
                            for text in (compact, padded)])
    (small, large), (small_refused, large_refused) = answers
    assert small.status_code == large.status_code == 200, (small.text, large.text)
    usages = [answer.json()["usage"] for answer in (small, large)]
    assert [(usage["prompt_tokens"], usage["completion_tokens"]) for usage in usages] == [
        (usages[0]["prompt_tokens"], usages[0]["completion_tokens"])] * 2
    # The second prompt's whole blocks were the first's, cached.
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] >= 16
    assert (small.json()["choices"][0]["message"]
            == large.json()["choices"][0]["message"])
    assert small_refused.status_code == large_refused.status_code == 400
    assert small_refused.json()["error"] == large_refused.json()["error"]
    assert rendered_by_the_route == [3, 1]  # the two small bodies only


def _cpu_classes_of_every_thread(processor: InputProcessor, body: object
                                 ) -> tuple[set[int], set[int]]:
    """(the scheduling policies, the nicenesses) of all the child's threads."""
    thread_ids = [int(name) for name in os.listdir("/proc/self/task")]
    return ({os.sched_getscheduler(tid) for tid in thread_ids},
            {os.getpriority(os.PRIO_PROCESS, tid) for tid in thread_ids})


def _parse_from_a_background_thread(parser: BodyParser) -> object:
    """What `_cpu_classes_of_every_thread` finds in a child started, as the server starts
    them, from a work-pool thread at niceness 10."""
    return _call_from_a_niced_thread(lambda: parser.parse(
        json.dumps(_chat()).encode(), "messages", ChatCompletionRequest,
        ChildPrompt(_cpu_classes_of_every_thread, ())).chat_prompt)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux's idle scheduling class")
def test_every_thread_of_the_child_runs_in_its_cpu_class(processor):
    """Whatever the child does with a body, it does on CPU no other task wants: all its
    threads, those its libraries started as it loaded the tokenizer included. With
    `cpu_class="niceness"`, at niceness 10 (set, not added to the niceness 10 that it
    inherits from the thread that started it)."""
    niceness = max(BACKGROUND_NICENESS, os.getpriority(os.PRIO_PROCESS, 0))
    results = []
    for cpu_class in ("idle", "niceness"):
        parser = BodyParser(num_processes=1, processor=processor, cpu_class=cpu_class)
        try:
            results.append(_parse_from_a_background_thread(parser))
        finally:
            parser.shutdown()
    assert results[0][0] == {os.SCHED_IDLE}
    assert results[1] == ({os.SCHED_OTHER}, {niceness})


def test_the_pools_helper_threads_run_at_the_priority_of_the_thread_that_built_it():
    """Bodies are parsed from niceness-10 background threads, but the pool's manager and
    the feeder that writes bodies to the children run at the niceness of the thread that
    built the parser (the event loop's), also for a pool that replaces a broken one."""
    niceness = os.getpriority(os.PRIO_PROCESS, 0)
    parser = BodyParser(num_processes=1)
    try:
        for _ in range(2):
            parsed = _call_from_a_niced_thread(lambda: parser.parse(b"[1]", None))
            assert parsed.value == [1]  # type: ignore[attr-defined]
            executor = parser._live_executor()
            # CPython's names for the pool's two helper threads.
            helpers = [executor._executor_manager_thread, executor._call_queue._thread]
            assert {os.getpriority(os.PRIO_PROCESS, helper.native_id)
                    for helper in helpers} == {niceness}
            for pid in list(executor._processes):
                os.kill(pid, 9)
            executor._executor_manager_thread.join(timeout=30)
    finally:
        parser.shutdown()


def _call_from_a_niced_thread(call: Callable[[], object]) -> object:
    """`call()`'s result, called from a new thread at niceness 10, as the work pool's
    background threads run."""
    results: list[object] = []

    def run() -> None:
        lower_thread_priority(BACKGROUND_NICENESS)
        results.append(call())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return results[0]


def _tools_count(num_tools: int, **fields: object) -> dict:
    return {"model": "tiny", "system": "be brief",
            "messages": [{"role": "user", "content": "which tool?"}],
            "tools": [{"name": f"tool_{index}", "input_schema": {"type": "object"}}
                      for index in range(num_tools)], **fields}


def test_a_body_offering_many_tools_is_parsed_off_the_loop_whatever_its_size() -> None:
    """So is every count of tokens, and no small body offering few tools, however many tool
    calls its conversation holds."""
    many, few = (json.dumps(_tools_count(n)).encode() for n in (INLINE_PARSE_TOOLS + 1, 8))
    chat_tools = json.dumps({"tools": [{"type": "function", "function": {
        "name": f"t{index}", "parameters": {}}} for index in range(INLINE_PARSE_TOOLS + 1)]})
    calls = json.dumps({"messages": [_chat()["messages"][1]] * 200})
    assert len(many) < INLINE_PARSE_BYTES and len(calls) < INLINE_PARSE_BYTES
    assert parsed_off_loop("/v1/messages", many)
    assert parsed_off_loop("/v1/chat/completions", chat_tools.encode())
    assert not parsed_off_loop("/v1/messages", few)
    assert not parsed_off_loop("/v1/chat/completions", calls.encode())
    assert parsed_off_loop("/v1/messages/count_tokens", few)
    assert parsed_off_loop("/v1/completions", b" " * (INLINE_PARSE_BYTES + 1) + b"{}")


def test_the_child_counts_a_count_tokens_prompt_as_the_route_would(preparing_parser,
                                                                   processor):
    """However long: 100 tools are far past the 64-token context. What the prompt stands
    for (messages, tools, system) does not come back."""
    body = _tools_count(100)
    parsed = preparing_parser.parse(json.dumps(body).encode(), "messages",
                                    MessagesCountTokensRequest, COUNT_PROMPT)
    validated = MessagesCountTokensRequest.model_validate(body)
    assert parsed.chat_prompt == count_prompt(processor, validated)
    assert len(parsed.chat_prompt.token_ids) > 100 * 8
    assert (parsed.value.messages, parsed.value.tools, parsed.value.system) == ([], None, None)
    refused = _tools_count(2, messages=[{"role": "assistant", "content": "hi"}])
    assert preparing_parser.parse(json.dumps(refused).encode(), "messages",
                                  MessagesCountTokensRequest, COUNT_PROMPT).chat_prompt is None


def test_a_count_is_made_in_the_child_as_the_route_would_make_it(server, monkeypatch):
    """A `count_tokens` body is counted in the parsing child, not on the server's threads,
    to the count the route makes of it; a body the child does not count (here, because it
    names a tool twice) gets the route's refusal."""
    counted_by_the_route: list[int] = []

    def counted(processor: InputProcessor, body: MessagesCountTokensRequest) -> ChatPrompt:
        counted_by_the_route.append(len(body.tools or ()))
        return count_prompt(processor, body)

    monkeypatch.setattr(serving_messages, "count_prompt", counted)
    bodies = [_tools_count(INLINE_PARSE_TOOLS + 1), _tools_count(2)]
    duplicate = _tools_count(3)
    duplicate["tools"][1]["name"] = "tool_0"
    with server.http() as http:
        counts = [http.post("/v1/messages/count_tokens", json=body) for body in bodies]
        refused = http.post("/v1/messages/count_tokens", json=duplicate)
    processor = server.engine.processor
    for body, count in zip(bodies, counts, strict=True):
        assert count.status_code == 200, count.text
        expected = count_prompt(processor, MessagesCountTokensRequest.model_validate(body))
        assert count.json() == {"input_tokens": len(expected.token_ids)}
    assert counted_by_the_route == []
    assert refused.status_code == 400 and "tool_0" in refused.text


def _failing_chat_prompt(processor: InputProcessor, body: object) -> ChatPrompt | None:
    raise RuntimeError("a bug")


def test_a_failure_to_make_the_prompt_leaves_it_to_the_route(preparing_parser):
    parsed = preparing_parser.parse(json.dumps(_chat()).encode(), "messages",
                                    ChatCompletionRequest,
                                    ChildPrompt(_failing_chat_prompt, (("messages", []),)))
    assert parsed.value == ChatCompletionRequest.model_validate(_chat())
    assert parsed.chat_prompt is None


class _BrokenParser:
    joined = BodyParser.joined  # a body under a mebibyte, as the parser gives it

    def __init__(self, error: Exception) -> None:
        self.error = error

    def parse(self, *args: object) -> ParsedBody:
        raise self.error


@pytest.mark.parametrize("error", [BrokenProcessPool("a child died"),
                                   ChildAnswerTimeout("no answer")])
def test_parse_children_that_keep_dying_or_do_not_answer_answer_503(error):
    app = pool_parsed_app(_BrokenParser(error))  # type: ignore[arg-type]

    @app.post("/v1/chat/completions")
    async def echo(body: dict) -> dict:
        return body

    with TestClient(app) as client:
        answer = client.post("/v1/chat/completions", json={"messages": ["x" * INLINE_PARSE_BYTES]})
    app.state.work_pool.shutdown()
    assert answer.status_code == 503
    assert answer.json()["detail"] == ("the server's body-parsing processes failed; retry the "
                                       "request")


def test_the_cpu_class_of_the_parse_children_is_a_config_file_setting(tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = tmp_path / "serve.toml"
    chosen = []
    for line in ("", 'large_body_cpu = "niceness"'):
        config.write_text(line + "\n")
        args = parser.parse_args(["--config", str(config)])
        chosen.append(server_settings_from_args(args).large_body_cpu)
    assert chosen == ["idle", "niceness"]
    config.write_text('large_body_cpu = "realtime"\n')
    with pytest.raises(SystemExit):
        parser.parse_args(["--config", str(config)])
    with pytest.raises(SystemExit):
        parser.parse_args(["--large-body-cpu", "niceness"])
    with pytest.raises(ValueError, match="large_body_cpu"):
        ServerSettings(served_model_name="tiny", large_body_cpu="realtime")  # type: ignore[arg-type]


def test_a_processor_that_cannot_be_copied_leaves_the_prompts_to_the_routes(processor):
    unpicklable = InputProcessor(processor.tokenizer, vocab_size=512, max_model_len=64)
    unpicklable.note = lambda: None  # type: ignore[attr-defined]
    parser = BodyParser(num_processes=1, processor=unpicklable)
    try:
        parsed = parser.parse(json.dumps(_chat()).encode(), "messages",
                              ChatCompletionRequest, CHAT_PROMPT)
    finally:
        parser.shutdown()
    assert parsed.value == ChatCompletionRequest.model_validate(_chat())
    assert parsed.chat_prompt is None
