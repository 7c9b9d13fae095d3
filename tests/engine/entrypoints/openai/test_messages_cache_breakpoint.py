"""A `cache_control` breakpoint sent to `/v1/messages` reaches the scheduler's request: a
stand-in policy pins a named job's turn for the breakpoint's TTL, seen in
`GET /v1/jobs/{job_id}` (Anthropic's "5m" and "1h", and a TTL past the server's cap clamped
to it)."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import pytest

from engine.entrypoints.openai import serving_messages
from tests.engine.entrypoints.openai.conftest import ServerThread, start_server

POLICY = "tests.engine.entrypoints.openai.breakpoint_policy:PinTheBreakpointPolicy"
SYSTEM_TEXT = "You are a patient assistant who answers in short sentences. " * 4


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    running = start_server(scheduling_policy=POLICY)
    yield running
    running.stop()


def _pinned_ttl_s(server: ServerThread, job_id: str, ttl: str | None) -> float | None:
    control = {"type": "ephemeral"} if ttl is None else {"type": "ephemeral", "ttl": ttl}
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    message = client.messages.create(
        model="tiny", max_tokens=4, messages=[{"role": "user", "content": "Hello."}],
        system=[{"type": "text", "text": SYSTEM_TEXT, "cache_control": control}],
        extra_body={"job_id": job_id})
    assert message.usage.cache_creation_input_tokens + message.usage.cache_read_input_tokens \
        > 0
    server.wait_idle()
    with server.http() as http:
        pin = http.get(f"/v1/jobs/{job_id}").json()["pin"]
    return None if pin is None else pin["ttl_s"]


def test_the_breakpoints_ttl_reaches_the_scheduler(server) -> None:
    assert _pinned_ttl_s(server, "five-minutes", None) == 300.0
    assert _pinned_ttl_s(server, "one-hour", "1h") == 3600.0


def test_a_ttl_past_the_cap_is_clamped(server, monkeypatch) -> None:
    monkeypatch.setattr(serving_messages, "MAX_CACHE_TTL_S", 600.0)
    assert _pinned_ttl_s(server, "clamped", "1h") == 600.0
    assert _pinned_ttl_s(server, "under-the-cap", "5m") == 300.0
