"""Live servers for the agent-framework compatibility suite, shared by all its modules and
started side by side (each start spawns an engine-core process).

`tiny_server` runs the tiny model (random weights): its structured outputs are enforced by
constrained decoding, so they parse and match their schema whatever the weights.
`agent_server` runs `ToolThenAnswerExecutor`: it calls `get_weather` on a conversation's first
turn and answers with the tool's result once the conversation holds one, so a framework's tool
loop over two turns is deterministic.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine.engine_args import EngineArgs
from engine.entrypoints.openai.serving import ServerSettings
from engine.frontend.tokenizer import load_tokenizer
from tests.compat.shared import AGENT_EXECUTOR, AGENT_MODEL, TINY_MODEL
from tests.engine.entrypoints.openai.conftest import MAX_BODY_BYTES, ServerThread


def _server(served_model_name: str, **engine_args: object) -> ServerThread:
    """A server (not started) with 256 KV blocks and prompts plus outputs of up to 1,024
    tokens (bytes, for the tiny tokenizer)."""
    return ServerThread(
        EngineArgs(num_kv_blocks=256, max_model_len=1024, **engine_args),
        ServerSettings(served_model_name=served_model_name,
                       max_request_body_bytes=MAX_BODY_BYTES))


@pytest.fixture(scope="package")
def servers() -> Iterator[dict[str, ServerThread]]:
    """Both servers by served model name, started in parallel."""
    load_tokenizer(TINY_MODEL)  # transformers' lazy imports race when two threads start them
    built = {TINY_MODEL: _server(TINY_MODEL),
             AGENT_MODEL: _server(AGENT_MODEL, executor=AGENT_EXECUTOR)}
    # One torch thread per engine core: the tiny model gains nothing from more, and on a busy
    # two-core machine their spinning slows each step several times over.
    with pytest.MonkeyPatch.context() as patch, ThreadPoolExecutor(len(built)) as pool:
        patch.setenv("OMP_NUM_THREADS", "1")  # read by the spawned core processes only
        starts = [pool.submit(server.start) for server in built.values()]
    try:
        for start in starts:
            start.result()
        yield built
        for server in built.values():
            server.wait_idle()  # every request ended; the core's invariants hold (no leaks)
    finally:
        for server in built.values():
            server.stop()


@pytest.fixture(scope="package")
def tiny_server(servers: dict[str, ServerThread]) -> ServerThread:
    return servers[TINY_MODEL]


@pytest.fixture(scope="package")
def agent_server(servers: dict[str, ServerThread]) -> ServerThread:
    return servers[AGENT_MODEL]
