"""No model output can end the engine: a turn whose output is a tool call with an integer
longer than Python converts (5,000 digits) is answered as text, on every API and with the
tools offered, and the server goes on serving. The engine core runs the scripted executor,
which writes that output for every request, under the default policy with job inference on,
so that the policy reads each turn's output for the tool it called (the parsers themselves
are fuzzed in test_tool_parsers.py)."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
from collections.abc import Iterator

import pytest

from engine.entrypoints.openai.serving import ServerSettings
from engine.model.tiny import TINY_MODEL_DIR
from tests.engine.entrypoints.openai.conftest import (
    MAX_BODY_BYTES,
    SCRIPTED,
    ServerThread,
    start_server,
)
from tests.engine.entrypoints.openai.scripted import HUGE_INTEGER_CALL

TOOL = {"name": "t", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}
BODIES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "go"}]},
    "/v1/completions": {"prompt": "go"},
    "/v1/responses": {"input": "go"},
    "/v1/messages": {"messages": [{"role": "user", "content": "go"}], "max_tokens": 6000},
}
TOOLS = {
    "/v1/chat/completions": {"tools": [{"type": "function", "function": TOOL}]},
    "/v1/responses": {"tools": [{"type": "function", **TOOL}]},
    "/v1/messages": {"tools": [{"name": "t", "input_schema": TOOL["parameters"]}]},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerThread]:
    # The tiny model's tokenizer writes a token a digit: its files with room for 8k positions
    # (the scripted executor runs no model).
    model_dir = tmp_path_factory.mktemp("tiny-8k")
    for path in TINY_MODEL_DIR.iterdir():
        if path.is_file():
            shutil.copy(path, model_dir / path.name)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config,
                                                       "max_position_embeddings": 8192}))
    running = start_server(
        model=str(model_dir), executor=f"{SCRIPTED}:HugeIntegerExecutor", max_model_len=8192,
        num_kv_blocks=1024, settings=ServerSettings(served_model_name="scripted",
                                                    max_request_body_bytes=MAX_BODY_BYTES))
    yield running
    running.stop()


def _post(server: ServerThread, path: str, body: dict) -> tuple[int, str]:
    with server.http() as http:
        response = http.post(path, json={"model": "scripted", "max_tokens": 6000, **body},
                             timeout=300)
    return response.status_code, response.text


@pytest.mark.parametrize("tools", [False, True], ids=["plain", "tools"])
@pytest.mark.parametrize("path", list(BODIES))
def test_a_tool_call_with_a_huge_integer_is_text_and_the_engine_survives(server, path, tools):
    if tools and path not in TOOLS:
        pytest.skip(f"{path} takes no tools")
    body = {**BODIES[path], **(TOOLS[path] if tools else {})}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        others = [pool.submit(_post, server, "/v1/completions", BODIES["/v1/completions"])
                  for _ in range(3)]
        status, text = _post(server, path, body)
        assert [other.result(timeout=300)[0] for other in others] == [200] * 3
    assert status == 200, text
    assert "9" * 4_400 in text and '"tool_calls":[{' not in text.replace(" ", "")
    assert '"type":"tool_use"' not in text.replace(" ", "")
    assert _post(server, "/v1/completions", BODIES["/v1/completions"])[0] == 200
    stats = server.wait_idle()
    assert stats.num_free_blocks + stats.num_pinned_blocks == stats.num_kv_blocks
    assert HUGE_INTEGER_CALL.startswith("<tool_call>")
