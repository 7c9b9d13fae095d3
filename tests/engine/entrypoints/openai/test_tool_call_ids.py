"""Tool call ids that name the engine request that issued them, and the request a
conversation continues, read from the calls it sends back."""

from __future__ import annotations

import pytest

from engine.entrypoints.openai.tool_call_ids import (
    continued_request_id,
    issued_call_id,
    issuing_request_id,
)


@pytest.mark.parametrize("request_id", ["chatcmpl-1f2e", "resp_9a-b", "chatcmpl-7-2", "x\ny"])
def test_an_issued_id_names_its_request(request_id: str) -> None:
    for index in (0, 3):
        assert issuing_request_id(issued_call_id(request_id, index)) == request_id


@pytest.mark.parametrize("call_id", ["call_abc", "call_-x", "call_x-y", "fc_0-r", "", None, 7])
def test_other_ids_name_nothing(call_id: object) -> None:
    assert issuing_request_id(call_id) is None


def _assistant(*call_ids: str) -> dict[str, object]:
    return {"role": "assistant", "content": "",
            "tool_calls": [{"id": call_id, "type": "function",
                            "function": {"name": "f", "arguments": {}}}
                           for call_id in call_ids]}


def test_a_conversation_continues_the_request_of_its_latest_calls() -> None:
    first, second = issued_call_id("req-1", 0), issued_call_id("req-2", 1)
    question = {"role": "user", "content": "go"}
    conversation = [question, _assistant(first), {"role": "tool", "tool_call_id": first},
                    _assistant(issued_call_id("req-2", 0), second)]
    assert continued_request_id(conversation) == "req-2"
    answered = [*conversation, {"role": "tool", "tool_call_id": second}]
    assert continued_request_id(answered) == "req-2"
    # The latest assistant turn called nothing, or not here: no request is named.
    assert continued_request_id([*answered, {"role": "assistant", "content": "done"},
                                 {"role": "user", "content": "more"}]) is None
    assert continued_request_id([question, _assistant("call_from_elsewhere")]) is None
    assert continued_request_id([question]) is None
