"""Large bodies are parsed on the preparation pool by an interruptible parser that reads
JSON exactly as `json.loads` does; the event loop keeps serving meanwhile."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import pytest

from engine.entrypoints.openai.json_body import INLINE_PARSE_BYTES, parse_json


@pytest.mark.parametrize("text", [
    '{"a": [1, 2.5, -3e2, true, false, null], "b": {"c": "d\\u00e9\\ud83d\\ude00"}}',
    '[NaN, Infinity, -Infinity]', '"lone \\ud800 surrogate"', '  {"deep": [[[[[]]]]]}  ',
])
@pytest.mark.parametrize("encoding", ["utf-8", "utf-16", "utf-32-le", "utf-8-sig"])
def test_parses_as_json_loads_does(text, encoding):
    body = text.encode(encoding)
    assert json.dumps(parse_json(body)) == json.dumps(json.loads(body))


@pytest.mark.parametrize("text", ['{"a": 1', '{"a": 1} x', "", "[1,]", '{"a" 1}'])
def test_refuses_what_json_loads_refuses(text):
    with pytest.raises(json.JSONDecodeError):
        json.loads(text.encode())
    with pytest.raises(json.JSONDecodeError):
        parse_json(text.encode())


def _longest_gap_s(parse: Callable[[bytes], object], body: bytes) -> float:
    """The longest this thread waited for the GIL while `parse` ran on another thread."""
    gaps_s: list[float] = []
    worker = threading.Thread(target=parse, args=(body,))
    last_s = time.perf_counter()
    worker.start()
    while worker.is_alive():
        time.sleep(0.001)
        now_s = time.perf_counter()
        gaps_s.append(now_s - last_s)
        last_s = now_s
    return max(gaps_s)


def test_a_large_parse_leaves_other_threads_running():
    """The C parser holds the GIL for a whole parse; this one gives it up as it goes."""
    body = json.dumps({"items": [{"type": "text", "text": "a"}] * 250_000}).encode()
    assert len(body) > 100 * INLINE_PARSE_BYTES
    c_parse_gap_s = _longest_gap_s(json.loads, body)
    assert _longest_gap_s(parse_json, body) < c_parse_gap_s / 2, c_parse_gap_s


def test_a_large_chat_body_is_served(server):
    filler = "word " * (INLINE_PARSE_BYTES // 4)
    body = {"model": "tiny", "max_tokens": 2, "messages": [
        {"role": "system", "content": "x", "metadata": filler},
        {"role": "user", "content": "hello"}]}
    with server.http() as http:
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        broken = http.post("/v1/chat/completions", content=json.dumps(body)[:-1].encode(),
                           headers={"Content-Type": "application/json"})
    assert broken.status_code == 400
    assert "JSON" in broken.json()["error"]["message"]
