"""Routing keys read from request bodies and headers at the ingress."""

from __future__ import annotations

import json

from engine.replicas.routing import rendezvous_rank
from engine.replicas.routing_key import (
    PROMPT_PREFIX_TOKENS,
    BodyRoute,
    body_route,
    job_key,
    routing_key,
)

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"


def key(path: str, body: object, headers: dict[str, str] | None = None) -> str | None:
    return routing_key(path, body, headers or {})


def test_an_explicit_job_is_the_key_whichever_way_it_is_named() -> None:
    assert key(CHAT, {"job_id": "j1", "messages": []}) == job_key("j1", {})
    assert key(CHAT, {"messages": []}, {"x-job-id": "j1"}) == job_key("j1", {})
    assert key("/v1/completions", {"prompt_cache_key": "j1", "prompt": "x"}) == \
        job_key("j1", {})
    assert job_key("j1", {}) != job_key("j2", {})


def test_keys_are_scoped_by_the_api_key() -> None:
    alice, bob = {"authorization": "Bearer alice"}, {"authorization": "Bearer bob"}
    assert job_key("j1", alice) != job_key("j1", bob)
    opening = {"messages": [{"role": "user", "content": "hi"}]}
    assert key(CHAT, opening, alice) == key(CHAT, opening, alice) != key(CHAT, opening, bob)


def test_a_conversations_turns_share_the_key_of_its_opening() -> None:
    opening = [{"role": "system", "content": "You are an agent."},
               {"role": "user", "content": "Fix the bug."}]
    later = [*opening, {"role": "assistant", "content": "", "tool_calls": []},
             {"role": "tool", "content": "ok", "tool_call_id": "c1"}]
    other = [opening[0], {"role": "user", "content": "Write the docs."}]
    assert key(CHAT, {"messages": opening}) == key(CHAT, {"messages": later})
    assert key(CHAT, {"messages": opening}) != key(CHAT, {"messages": other})
    assert key(CHAT, {"messages": "not a list"}) is None


def test_a_messages_conversation_is_keyed_like_a_chat_with_its_system_prompt() -> None:
    opening = [{"role": "user", "content": [{"type": "text", "text": "Fix the bug."}]}]
    later = [*opening,
             {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "sh",
                                                "input": {"cmd": "ls"}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                           "content": "a.py"}]}]
    system = [{"type": "text", "text": "You are a coding agent.",
               "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    first = key(MESSAGES, {"system": system, "messages": opening})
    assert first is not None
    assert first == key(MESSAGES, {"system": system, "messages": later})
    assert first == key(MESSAGES, {"system": "You are a coding agent.", "messages": later})
    assert first != key(MESSAGES, {"system": "You review code.", "messages": opening})
    assert key(MESSAGES, {"messages": opening}) == key(CHAT, {"messages": [
        {"role": "user", "content": "Fix the bug."}]})
    assert key(MESSAGES, {"messages": "not a list"}) is None
    assert key(MESSAGES + "/count_tokens", {"messages": opening}) is None


def test_an_x_api_key_scopes_keys_as_the_same_bearer_token_does() -> None:
    opening = {"messages": [{"role": "user", "content": "hi"}]}
    bearer, anthropic = {"authorization": "Bearer alice"}, {"x-api-key": "alice"}
    assert key(MESSAGES, opening, anthropic) == key(MESSAGES, opening, bearer)
    assert job_key("j1", anthropic) == job_key("j1", bearer)
    assert key(MESSAGES, opening, anthropic) != key(MESSAGES, opening, {"x-api-key": "bob"})


def test_completions_are_keyed_by_their_prompts_opening() -> None:
    ids = list(range(PROMPT_PREFIX_TOKENS + 5))
    assert key("/v1/completions", {"prompt": ids}) == \
        key("/v1/completions", {"prompt": [*ids, 7, 8]})
    assert key("/v1/completions", {"prompt": [ids]}) == key("/v1/completions", {"prompt": ids})
    assert key("/v1/completions", {"prompt": "a b c"}) != key("/v1/completions", {"prompt": "x"})
    assert key("/v1/completions", {"prompt": ["one", "two"]}) is None  # a batch: no job


def test_a_message_is_keyed_by_its_text_however_it_is_given() -> None:
    as_string = key("/v1/responses", {"input": "hello", "instructions": "be brief"})
    as_parts = key("/v1/responses", {"instructions": "be brief", "input": [
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "hel"}, {"type": "input_text", "text": "lo"}]},
        {"type": "message", "role": "assistant", "content": "later turns do not count"}]})
    assert as_string is not None and as_string == as_parts
    assert key("/v1/responses", {"input": "hello"}) != as_string  # other instructions


def test_malformed_bodies_have_no_key() -> None:
    assert key(CHAT, None) is None
    assert key(CHAT, [1, 2]) is None
    assert key(CHAT, {"job_id": 5, "messages": []}) is None


def test_a_body_route_is_its_key_and_the_response_it_continues() -> None:
    """What the ingress routes a generation body by (read in a child from a large one): its
    routing key, and a `previous_response_id` only when it is a string; neither for a body
    that does not parse, however it fails."""
    headers = {"authorization": "Bearer alice"}
    follow_up = {"input": "go on", "previous_response_id": "resp_1"}
    assert body_route("/v1/responses", headers, json.dumps(follow_up).encode()) == BodyRoute(
        routing_key("/v1/responses", follow_up, headers), "resp_1")
    numbered = json.dumps({**follow_up, "previous_response_id": 7}).encode()
    assert body_route("/v1/responses", headers, numbered).previous_response_id is None
    for malformed in (b'{"messages": ', b"[" * 100_000, b"\xff"):
        assert body_route(CHAT, headers, malformed) == BodyRoute(None, None)


def test_a_lone_surrogate_in_a_body_still_has_a_key_and_a_replica() -> None:
    """JSON escapes can spell a lone surrogate, which UTF-8 refuses: such a conversation or
    job still has a key (the ingress answered 500 before), and a replica to go to."""
    for body in (b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
                 b'{"job_id": "\\udfff", "messages": []}'):
        key = body_route(CHAT, {}, body).key
        assert key is not None
        assert sorted(rendezvous_rank(key, ["a", "b"])) == ["a", "b"]


def test_keys_and_ranks_of_valid_text_stay_as_they_were() -> None:
    """Routing must not move a conversation between versions: these keys and replica orders
    were computed by a35e6fb's code, before keys were encoded to allow lone surrogates."""
    headers = {"authorization": "Bearer alice"}
    scope = "57960de955fc/"
    assert key(CHAT, {"messages": [{"role": "system", "content": "be brief"},
                                   {"role": "user", "content": "hello"}]}, headers) == \
        scope + "conversation:be515bcb8051b20fb8ffc8dc"
    assert key(CHAT, {"messages": [{"role": "user", "content": "d\u00e9j\u00e0 vu"}]},
               headers) == scope + "conversation:fcff7933e6025352a5b84df1"
    assert key("/v1/responses", {"input": "emoji \U0001F600", "instructions": "x"},
               headers) == scope + "conversation:ee922e4e1ade52615863f42d"
    assert key("/v1/completions", {"prompt": "caf\u00e9 " * 3}, headers) == \
        scope + "prompt:ea05454742864725d5073b00"
    replicas = ["r1", "r2", "r3", "r4"]
    assert rendezvous_rank("alice/job:j1", replicas) == ["r1", "r4", "r2", "r3"]
    assert rendezvous_rank("x/conversation:\u00e9\U0001F600", replicas) == \
        ["r4", "r1", "r3", "r2"]
