"""Large response bodies: their JSON in pieces is the whole JSON, each piece bounded, and a
pieces response declares its length and sends every piece."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec
import pytest

from engine.entrypoints.openai.response_body import (
    LARGE_BODY_BYTES,
    MAX_WALKED_ITEMS,
    PIECE_BYTES,
    JSONPiecesResponse,
    byte_pieces,
    is_large,
    json_pieces,
)


def _logprob(index: int) -> dict[str, Any]:
    return {"token": f"t{index}\u2028", "logprob": -index / 7, "bytes": [116, 48],
            "top_logprobs": [{"token": f"a{k}", "logprob": -k / 3, "bytes": [97]}
                             for k in range(20)]}


BODIES = [
    {},
    [],
    {"a": [], "b": {}, "c": None, "d": "é", "e": 1.5, "f": True},
    {"output": [{"content": [{"logprobs": [_logprob(i) for i in range(3000)]}]}]},
    {"choices": [{"index": i, "logprobs": {"tokens": ["x"] * 500, "text_offset": list(
        range(500))}} for i in range(MAX_WALKED_ITEMS + 5)]},
    {"raw": msgspec.Raw(b'{"pre":[1,2,3]}'), "list": [msgspec.Raw(b"[]")] * 40},
]


@pytest.mark.parametrize("body", BODIES)
def test_the_pieces_make_the_whole_json(body: Any) -> None:
    pieces = json_pieces(body)
    assert b"".join(pieces) == msgspec.json.encode(body)
    assert json.loads(b"".join(pieces)) == json.loads(msgspec.json.encode(body))


def test_a_long_list_is_cut_into_pieces_of_about_the_piece_size() -> None:
    body = {"logprobs": [_logprob(i) for i in range(20_000)]}
    pieces = json_pieces(body)
    whole = b"".join(pieces)
    assert len(whole) > 20 * PIECE_BYTES
    assert len(pieces) >= len(whole) // (2 * PIECE_BYTES)
    # One slice of the list is encoded at a time: no piece is much over the piece size.
    assert max(map(len, pieces)) < 2 * PIECE_BYTES


def test_byte_pieces_slice_the_bytes_as_they_are() -> None:
    data = bytes(range(256)) * (3 * PIECE_BYTES // 256 + 7)
    pieces = byte_pieces(data)
    assert b"".join(pieces) == data and {len(p) for p in pieces[:-1]} == {PIECE_BYTES}
    assert all(piece.obj is data for piece in pieces)  # views, not copies
    assert byte_pieces(b"") == []


def test_only_bodies_over_the_threshold_are_large() -> None:
    assert not is_large(1000, 1000)
    assert is_large(LARGE_BODY_BYTES, 0)
    assert is_large(0, 84_000)  # 4,000 tokens with 20 alternatives each


def test_a_pieces_response_declares_its_length_and_sends_every_piece() -> None:
    pieces = [b'{"a":', b"[1,2]", b"}"]
    response = JSONPiecesResponse(pieces)
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        raise AssertionError("a pieces response reads nothing")

    asyncio.run(response({"type": "http"}, receive, send))
    start, *bodies = sent
    assert start["status"] == 200
    headers = dict(start["headers"])
    assert headers[b"content-length"] == b"11"
    assert headers[b"content-type"] == b"application/json"
    assert b"".join(message["body"] for message in bodies) == b'{"a":[1,2]}'
    assert [message["more_body"] for message in bodies] == [True, True, True, False]
