"""A real uvicorn server on a loopback port, running in a thread of the test process, with the
engine core in its own process; tests talk to it with the `openai` SDK and httpx."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import httpx
import openai
import pytest
import uvicorn

from engine.core.wire import EngineStats
from engine.engine_args import EngineArgs
from engine.entrypoints.connections import ConnectionSettings, guarded_protocol
from engine.entrypoints.openai.api_server import build_app
from engine.entrypoints.openai.serving import ServerSettings
from engine.entrypoints.openai.tenants import Tenants
from engine.entrypoints.serve import bind_socket
from engine.frontend.async_llm import AsyncLLM

SCRIPTED = "tests.engine.entrypoints.openai.scripted"
MAX_BODY_BYTES = 256 * 1024


class ServerThread:
    """Serves the app on 127.0.0.1:<free port> until `stop()`."""

    def __init__(self, engine_args: EngineArgs, settings: ServerSettings,
                 api_key: str | None = None, guarded: bool = False) -> None:
        config = engine_args.to_engine_config()
        self.settings = settings
        self.api_key = api_key
        self.app = build_app(lambda observer: AsyncLLM(config, stats_observer=observer),
                             settings)
        self._sock = bind_socket("127.0.0.1", 0)
        self.base_url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        # `guarded`: the connection protocol of `continuum serve` (timeouts, cap, peer close)
        protocol: Any = guarded_protocol(ConnectionSettings()) if guarded else "auto"
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning",
                                                     http=protocol))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._server.serve(sockets=[self._sock]))

    def start(self, timeout_s: float = 120.0) -> ServerThread:
        self._thread.start()
        deadline_s = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline_s:
                raise RuntimeError("the test server did not start")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(60)
        self._sock.close()

    @property
    def engine(self) -> AsyncLLM:
        return self.app.state.engine

    @property
    def num_requests_in_progress(self) -> int:
        """Requests whose headers uvicorn has parsed and whose response has not ended."""
        return len(self._server.server_state.tasks)

    def run(self, make: Callable[[AsyncLLM], Coroutine[Any, Any, Any]]) -> Any:
        """Runs `make(engine)` in the server's event loop and returns its result."""
        future = asyncio.run_coroutine_threadsafe(make(self.engine), self._loop)
        return future.result(30)

    def stats(self) -> EngineStats:
        return self.run(lambda engine: engine.get_stats())

    def wait_idle(self, timeout_s: float = 30.0) -> EngineStats:
        """Waits until the core runs nothing, and checks its invariants; the final stats."""
        deadline_s = time.monotonic() + timeout_s
        while True:
            stats = self.stats()
            if stats.num_running == 0 and stats.num_waiting == 0:
                self.run(lambda engine: engine.check_invariants())
                return stats
            if time.monotonic() > deadline_s:
                raise AssertionError(f"the engine did not go idle: {stats}")
            time.sleep(0.05)

    def client(self, **kwargs: Any) -> openai.OpenAI:
        kwargs.setdefault("api_key", self.api_key or "unused")
        return openai.OpenAI(base_url=self.base_url + "/v1", max_retries=0, timeout=60,
                             **kwargs)

    def http(self, **kwargs: Any) -> httpx.Client:
        kwargs.setdefault("timeout", 60)
        return httpx.Client(base_url=self.base_url, **kwargs)

    def metric(self, name: str, labels: str = "") -> float:
        """The value of one sample in /metrics (0 if absent), e.g. metric("num_pins")."""
        headers = {}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        text = httpx.get(self.base_url + "/metrics", headers=headers, timeout=30).text
        pattern = rf"^continuum:{re.escape(name)}\{{([^}}]*)\}} (\S+)$"
        for match in re.finditer(pattern, text, re.MULTILINE):
            if all(part in match.group(1) for part in labels.split(",") if part):
                return float(match.group(2))
        return 0.0


def start_server(**overrides: Any) -> ServerThread:
    settings = overrides.pop("settings", None) or ServerSettings(
        served_model_name="tiny", max_request_body_bytes=MAX_BODY_BYTES)
    api_key = overrides.pop("api_key", None)
    guarded = overrides.pop("guarded", False)
    engine_args = EngineArgs(**{"num_kv_blocks": 256, "max_model_len": 1024, **overrides})
    return ServerThread(engine_args, settings, api_key, guarded).start()


@pytest.fixture(scope="package")
def server() -> Iterator[ServerThread]:
    """The tiny model, the default policy (continuum), 256 KV blocks of 16 tokens,
    max_model_len 1024, request bodies up to `MAX_BODY_BYTES`."""
    running = start_server()
    yield running
    running.stop()


def start_scripted_server() -> ServerThread:
    """Every request outputs a scripted tool call; job turns are pinned; an API key is set."""
    return start_server(
        executor=f"{SCRIPTED}:ScriptedExecutor",
        scheduling_policy=f"{SCRIPTED}:PinJobTurnsPolicy",
        settings=ServerSettings(served_model_name="scripted",
                                tenants=Tenants.from_pairs([("secret-key", "default")])),
        api_key="secret-key",
    )


@pytest.fixture(scope="package")
def scripted_server() -> Iterator[ServerThread]:
    """`start_scripted_server`'s server, shared by the package's tests (their pinned jobs
    stay pinned for the next test file that uses it)."""
    running = start_scripted_server()
    yield running
    running.stop()
