"""The load clients' pure pieces: the check of a complete answer, event-stream lines, the
request budget and the settings' validation (the clients against a server:
`tests/lab/bench/test_load.py`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from lab.load_clients import (
    ERROR,
    OK,
    LoadMix,
    LoadSettings,
    RequestBudget,
    check_answer,
    sse_lines,
)


def test_complete_answers_must_have_the_forced_length() -> None:
    body = {"max_tokens": 4, "return_token_ids": True}
    assert check_answer(body, "length", {"completion_tokens": 4}, (1, 2, 3, 4)).outcome == OK
    assert check_answer(body, "stop", {"completion_tokens": 4}, (1, 2, 3, 4)).outcome == ERROR
    assert check_answer(body, "length", {"completion_tokens": 3}, (1, 2, 3)).outcome == ERROR
    assert check_answer(body, "length", None, (1, 2, 3, 4)).outcome == ERROR
    assert check_answer(body, "length", {"completion_tokens": 4}, (1,)).outcome == ERROR


def test_event_stream_lines_split_only_at_cr_and_lf() -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for chunk in (b'data: {"text": "a\xe2\x80\xa8b\xc2\x85c"}\r', b"\n\r\nda",
                      b"ta: [DONE]\n\n", b"tail"):
            yield chunk

    async def collect() -> list[str]:
        return [line async for line in sse_lines(chunks())]

    assert asyncio.run(collect()) == [
        'data: {"text": "a\u2028b\u0085c"}', "", "data: [DONE]", "", "tail"]


def test_the_budget_hands_out_requests_until_count_or_time_runs_out() -> None:
    budget = RequestBudget(5, deadline_s=time.monotonic() + 60.0)
    assert [budget.take(3), budget.take(3), budget.take(1)] == [3, 2, 0]
    assert budget.exhausted()
    late = RequestBudget(5, deadline_s=time.monotonic() - 1.0)
    assert late.take(1) == 0 and late.exhausted()


def test_load_settings_are_validated() -> None:
    with pytest.raises(ValueError):
        LoadSettings(num_clients=0)
    with pytest.raises(ValueError):
        LoadSettings(max_tokens=65, long_max_tokens=64)
    with pytest.raises(ValueError):
        LoadSettings(tool_gap_s=(0.5, 0.1))
    with pytest.raises(ValueError):
        LoadMix(agent_job=-1.0)
    with pytest.raises(ValueError):
        LoadMix(**dict.fromkeys(("stream_completion", "completion", "stream_chat", "chat",
                                 "stream_disconnect", "give_up", "agent_job"), 0.0))
