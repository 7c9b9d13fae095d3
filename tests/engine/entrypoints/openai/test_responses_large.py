"""Large Responses API responses: built off the event loop, their closing events and their
stored copy sharing one encoding, and retrieved as the bytes first sent, never decoded. The
package's server (tiny model)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine.entrypoints.openai.response_store import StoredResponse
from tests.engine.entrypoints.openai.conftest import start_server


@pytest.fixture
def no_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stored response's body may not be decoded."""
    def refuse(self: StoredResponse) -> dict[str, Any]:
        raise AssertionError("a stored response was decoded")
    monkeypatch.setattr(StoredResponse, "body", refuse)


@pytest.mark.parametrize(("max_output_tokens", "top_logprobs"), [(40, 2), (900, 20)])
def test_a_stored_response_is_retrieved_as_the_bytes_first_sent(
        server, no_decoding, max_output_tokens, top_logprobs):
    """A small response and a large one (900 tokens x 21 values, built off the event loop):
    GET sends the bytes the POST sent, neither decoded nor encoded again."""
    body = {"model": "tiny", "input": "hello", "max_output_tokens": max_output_tokens,
            "ignore_eos": True, "include": ["message.output_text.logprobs"],
            "top_logprobs": top_logprobs}
    with server.http() as http:
        created = http.post("/v1/responses", json=body)
        assert created.status_code == 200, created.text
        response = created.json()
        (part,) = response["output"][0]["content"]
        assert len(part["logprobs"]) == max_output_tokens
        assert {len(entry["top_logprobs"]) for entry in part["logprobs"]} == {top_logprobs}
        retrieved = http.get(f"/v1/responses/{response['id']}")
        assert retrieved.status_code == 200
        assert retrieved.headers["content-type"] == "application/json"
        assert retrieved.content == created.content


def test_a_large_streamed_responses_closing_events_match_what_is_stored(server, no_decoding):
    body = {"model": "tiny", "input": "hello", "max_output_tokens": 900, "stream": True,
            "ignore_eos": True, "include": ["message.output_text.logprobs"],
            "top_logprobs": 20}
    events: dict[str, Any] = {}
    with server.http() as http:
        with http.stream("POST", "/v1/responses", json=body) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: "):
                    event = json.loads(line[6:])
                    events[event["type"]] = event
        completed = events["response.incomplete"]["response"]  # at max_output_tokens
        retrieved = http.get(f"/v1/responses/{completed['id']}")
    assert retrieved.json() == completed
    logprobs = completed["output"][0]["content"][0]["logprobs"]
    assert len(logprobs) == 900
    assert events["response.output_text.done"]["logprobs"] == logprobs
    assert events["response.content_part.done"]["part"]["logprobs"] == logprobs
    numbers = [event["sequence_number"] for event in events.values()]
    assert len(set(numbers)) == len(numbers)


def test_serves_own_protocol_sends_a_large_stored_response_whole(no_decoding):
    """`continuum serve`'s connection protocol (h11) takes the stored bytes' views as they
    are."""
    guarded = start_server(guarded=True)
    try:
        with guarded.http() as http:
            created = http.post("/v1/responses", json={
                "model": "tiny", "input": "hello", "max_output_tokens": 900, "ignore_eos": True,
                "include": ["message.output_text.logprobs"], "top_logprobs": 20})
            assert created.status_code == 200 and len(created.content) > 1024 * 1024
            retrieved = http.get(f"/v1/responses/{created.json()['id']}")
        assert retrieved.content == created.content
        assert int(retrieved.headers["content-length"]) == len(created.content)
    finally:
        guarded.stop()
