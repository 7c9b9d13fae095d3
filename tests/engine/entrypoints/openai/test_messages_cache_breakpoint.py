"""A `cache_control` breakpoint sent to `/v1/messages` becomes a client pin under the server's
default policy (continuum): the prompt's prefix up to the breakpoint is kept for the
breakpoint's TTL (Anthropic's "5m" and "1h"; a TTL past the server's cap is clamped to it),
seen in `GET /v1/jobs/{job_id}`, kept again by the turn that hit it, and the usage of both
turns counts what was written under the breakpoint and what was read from the cache."""

from __future__ import annotations

from typing import Any

import anthropic

from engine.entrypoints.openai import messages_prompt
from tests.engine.entrypoints.openai.conftest import ServerThread

BLOCK_SIZE = 16  # the test server's KV block size, in tokens
FIRST_QUESTION = {"role": "user", "content": "Hello."}
FOLLOW_UP = {"role": "user", "content": "And once more?"}


def _system(job_id: str, ttl: str | None) -> list[dict[str, Any]]:
    """A system prompt of several blocks, its own per job (no other job's cache to hit)."""
    control = {"type": "ephemeral"} if ttl is None else {"type": "ephemeral", "ttl": ttl}
    text = f"{job_id[::-1]}: you are patient and answer in short sentences. " * 6
    return [{"type": "text", "text": text, "cache_control": control}]


def _client(server: ServerThread) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)


def _job(server: ServerThread, job_id: str) -> dict[str, Any]:
    server.wait_idle()
    with server.http() as http:
        response = http.get(f"/v1/jobs/{job_id}")
    assert response.status_code == 200, response.text
    return response.json()


def _two_turns(server: ServerThread, job_id: str, ttl: str | None, pinned_ttl_s: float) -> None:
    """Two turns of a job under one breakpoint: each leaves a pin of `pinned_ttl_s`, the
    second reads the first's pinned prefix, and usage adds up to the counted prompt."""
    client = _client(server)
    system = _system(job_id, ttl)
    messages: list[dict[str, Any]] = [FIRST_QUESTION]
    first = client.messages.create(model="tiny", max_tokens=4, system=system,
                                   messages=messages, extra_body={"job_id": job_id})
    counted = client.messages.count_tokens(model="tiny", system=system,
                                           messages=messages).input_tokens
    usage = first.usage
    assert usage.cache_read_input_tokens == 0
    assert 0 < usage.cache_creation_input_tokens < counted
    assert usage.input_tokens + usage.cache_creation_input_tokens == counted
    pin = _job(server, job_id)["pin"]
    assert pin is not None and pin["request_id"] == first.id
    assert pin["ttl_s"] == pinned_ttl_s and pin["source"] == "client"
    assert pin["num_blocks"] == usage.cache_creation_input_tokens // BLOCK_SIZE

    messages = [*messages, {"role": "assistant", "content": first.content}, FOLLOW_UP]
    second = client.messages.create(model="tiny", max_tokens=4, system=system,
                                    messages=messages, extra_body={"job_id": job_id})
    counted = client.messages.count_tokens(model="tiny", system=system,
                                           messages=messages).input_tokens
    usage = second.usage
    assert usage.cache_read_input_tokens >= pin["num_blocks"] * BLOCK_SIZE > 0
    assert usage.cache_creation_input_tokens == 0  # the breakpoint's prefix was all read
    assert usage.input_tokens + usage.cache_read_input_tokens == counted
    job = _job(server, job_id)
    refreshed = job["pin"]
    assert refreshed is not None and refreshed["request_id"] == second.id
    assert refreshed["ttl_s"] == pinned_ttl_s and refreshed["source"] == "client"
    assert refreshed["remaining_ttl_s"] > pinned_ttl_s - 60
    assert job["policy"]["pins_released"] == {"reused": 1}
    _release(server, job_id)


def _release(server: ServerThread, job_id: str) -> None:
    """Ends the job and its pin: the server is shared with tests that expect every block free
    once the engine is idle, and a client pin would hold its blocks for minutes."""
    with server.http() as http:
        response = http.delete(f"/v1/jobs/{job_id}")
    assert response.status_code == 200, response.text
    assert response.json()["released_pin"] is True


def test_five_minutes_is_a_pin_of_300_s_refreshed_on_a_hit(server) -> None:
    _two_turns(server, "breakpoint-default-ttl", None, 300.0)
    _two_turns(server, "breakpoint-five-minutes", "5m", 300.0)


def test_one_hour_is_a_pin_of_3600_s_refreshed_on_a_hit(server) -> None:
    _two_turns(server, "breakpoint-one-hour", "1h", 3600.0)


def test_a_ttl_past_the_cap_is_clamped(server, monkeypatch) -> None:
    monkeypatch.setattr(messages_prompt, "MAX_CACHE_TTL_S", 600.0)
    _two_turns(server, "breakpoint-clamped", "1h", 600.0)
    _two_turns(server, "breakpoint-under-the-cap", "5m", 300.0)
