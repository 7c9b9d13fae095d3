"""Live servers for the agent-framework compatibility suite, shared by all its modules and
started side by side (each start spawns an engine-core process).

`tiny_server` runs the tiny model (random weights): its structured outputs are enforced by
constrained decoding, so they parse and match their schema whatever the weights.
`agent_server` runs `ToolThenAnswerExecutor`: it calls `get_weather` for each city a
conversation's question names, one turn each, and then answers with the tool's last result, so a
framework's tool loop is deterministic. Both servers trace every scheduler step to a file
(`TracedServer.trace`), from which the suite reads the jobs that the engine gave each turn.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from engine.engine_args import EngineArgs
from engine.entrypoints.openai.serving import ServerSettings
from engine.model.tokenizer import load_tokenizer
from tests.compat.jobs import TracedServer
from tests.compat.shared import AGENT_EXECUTOR, AGENT_MODEL, BLOCK_SIZE, MAX_MODEL_LEN, TINY_MODEL
from tests.engine.entrypoints.openai.conftest import MAX_BODY_BYTES


def _server(served_model_name: str, trace: Path, **engine_args: object) -> TracedServer:
    """A server (not started) with 256 KV blocks and prompts plus outputs of up to
    `MAX_MODEL_LEN` tokens (bytes, for the tiny tokenizer), tracing to `trace`."""
    return TracedServer(
        EngineArgs(num_kv_blocks=256, max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
                   trace_path=str(trace), **engine_args),
        ServerSettings(served_model_name=served_model_name,
                       max_request_body_bytes=MAX_BODY_BYTES), trace=trace)


@pytest.fixture(scope="package")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, TracedServer]]:
    """Both servers by served model name, started in parallel."""
    load_tokenizer(TINY_MODEL)  # transformers' lazy imports race when two threads start them
    traces = tmp_path_factory.mktemp("traces")
    built = {TINY_MODEL: _server(TINY_MODEL, traces / "tiny.jsonl"),
             AGENT_MODEL: _server(AGENT_MODEL, traces / "agent.jsonl",
                                  executor=AGENT_EXECUTOR)}
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
def tiny_server(servers: dict[str, TracedServer]) -> TracedServer:
    return servers[TINY_MODEL]


@pytest.fixture(scope="package")
def agent_server(servers: dict[str, TracedServer]) -> TracedServer:
    return servers[AGENT_MODEL]
