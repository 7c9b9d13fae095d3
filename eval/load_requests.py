"""One generation request of the load test, as the server should answer it: an HTTP
exchange (plain JSON or an SSE stream, optionally cut short or given up on) and the check of
a complete answer. Pure functions of an `httpx.AsyncClient`; the load test tallies the
`Reply`s."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any

import httpx

OK, DISCONNECTED, GAVE_UP, REJECTED, ERROR = "ok", "disconnected", "gave_up", "rejected", "error"


@dataclass(frozen=True)
class Reply:
    """How one request ended, and the generated token ids when it completed."""

    outcome: str
    token_ids: tuple[int, ...] = ()
    error: str | None = None


async def exchange(http: httpx.AsyncClient, path: str, body: dict[str, Any], *, stream: bool,
                   cut_after_chunks: int | None = None,
                   give_up_after_s: float | None = None) -> Reply:
    """Sends `body` to `path` and reads the answer: the whole of it, the first
    `cut_after_chunks` chunks of a stream, or what arrives within `give_up_after_s`.
    Transport errors raise `httpx.HTTPError`."""
    reading = (_stream(http, path, body, cut_after_chunks) if stream
               else _post(http, path, body))
    return await _within(reading, give_up_after_s)


async def _within(reading: Awaitable[Reply], give_up_after_s: float | None) -> Reply:
    if give_up_after_s is None:
        return await reading
    try:
        async with asyncio.timeout(give_up_after_s):
            return await reading
    except TimeoutError:
        return Reply(GAVE_UP)


def forced_length(max_tokens: int, stream: bool) -> dict[str, Any]:
    """Body fields that make a completion generate exactly `max_tokens` tokens (and report
    its usage when streamed)."""
    body: dict[str, Any] = {"max_tokens": max_tokens, "min_tokens": max_tokens,
                            "ignore_eos": True}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def _post(http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> Reply:
    response = await http.post(path, json=body)
    if response.status_code != 200:
        return _refused(response.status_code)
    try:
        payload = response.json()
        choice = payload["choices"][0]
        usage = payload["usage"]
    except (ValueError, KeyError, IndexError, TypeError):
        return Reply(ERROR, error="malformed body")
    return check_answer(body, choice.get("finish_reason"), usage,
                        tuple(choice.get("token_ids") or ()))


async def _stream(http: httpx.AsyncClient, path: str, body: dict[str, Any],
                  cut_after_chunks: int | None) -> Reply:
    """Reads an SSE stream to `[DONE]`, or closes it after `cut_after_chunks` chunks."""
    async with http.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return _refused(response.status_code)
        num_chunks = 0
        finish_reason = usage = None
        token_ids: list[int] = []
        async for line in sse_lines(response.aiter_bytes()):
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return check_answer(body, finish_reason, usage, tuple(token_ids))
            try:
                chunk = json.loads(line[len("data: "):])
            except ValueError:
                return Reply(ERROR, error=f"malformed chunk {line[:160]!r}")
            if "error" in chunk:
                return Reply(ERROR, error=f"error event: {chunk['error']}")
            for choice in chunk.get("choices", ()):
                finish_reason = choice.get("finish_reason") or finish_reason
                token_ids.extend(choice.get("token_ids") or ())
            usage = chunk.get("usage") or usage
            num_chunks += 1
            if cut_after_chunks is not None and num_chunks >= cut_after_chunks:
                return Reply(DISCONNECTED)
    return Reply(ERROR, error="stream ended without [DONE]")


async def sse_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The lines of an event stream, split at CR, LF or CRLF only, as the SSE format says.
    (httpx's `aiter_lines` also splits at U+0085, U+2028 and U+2029, which JSON leaves
    unescaped inside strings, so generated text can cut a `data:` line in two.)"""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        # A CR at the end may be the first half of a CRLF split between chunks.
        held = b"\r" if buffer.endswith(b"\r") else b""
        text = buffer[:len(buffer) - len(held)]
        *lines, rest = text.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        buffer = rest + held
        for line in lines:
            yield line.decode("utf-8", errors="replace")
    if buffer.rstrip(b"\r"):
        yield buffer.rstrip(b"\r").decode("utf-8", errors="replace")


def _refused(status: int) -> Reply:
    if status == 429:
        return Reply(REJECTED)
    return Reply(ERROR, error=f"HTTP {status}")


def check_answer(body: dict[str, Any], finish_reason: str | None,
                 usage: dict[str, Any] | None, token_ids: tuple[int, ...]) -> Reply:
    """A complete answer must have generated exactly the forced number of tokens."""
    expected = body["max_tokens"]
    if finish_reason != "length":
        return Reply(ERROR, error=f"finish_reason {finish_reason}")
    if usage is None or usage.get("completion_tokens") != expected:
        return Reply(ERROR, error="wrong completion_tokens")
    if body.get("return_token_ids") and len(token_ids) != expected:
        return Reply(ERROR, error="wrong token_ids")
    return Reply(OK, token_ids=token_ids)

