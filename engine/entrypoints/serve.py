"""`continuum serve`: the OpenAI-compatible HTTP server on uvicorn.

With no arguments it serves the embedded `tiny` model on 127.0.0.1:8000. Its flags and
`--config` file are those of `engine.entrypoints.server_args`. The process exits with status 1
when the engine core dies (after answering 503 to what is in flight), for a supervisor to
restart.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import signal
import socket
from collections.abc import Callable, Iterator

import uvicorn

from engine.core.gc_heap import freeze_startup_heap
from engine.core.malloc_thresholds import keep_large_buffers_in_heap
from engine.engine_args import EngineArgs
from engine.entrypoints.connections import setup_connection_guards
from engine.entrypoints.openai.api_server import begin_drain, build_app
from engine.entrypoints.server_args import add_arguments as add_arguments  # the CLI reads it here
from engine.entrypoints.server_args import (
    connection_settings_from_args,
    server_settings_from_args,
)
from engine.frontend.async_llm import AsyncLLM
from engine.frontend.stats import RequestStatsObserver
from engine.replicas.launch import main as serve_replicas

logger = logging.getLogger("continuum.serve")

# Once the drain ends the streams still open, they get this long to send their last events
# before uvicorn cancels them.
DRAIN_MARGIN_S = 5.0


class DrainingServer(uvicorn.Server):
    """uvicorn's server, which starts the app's drain as it begins to shut down (after it
    stops accepting connections, before it waits for those open to finish)."""

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_shutdown = on_shutdown

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._on_shutdown()
        await super().shutdown(sockets=sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            # uvicorn re-raises the signals it caught once it is done; a SIGTERM or Ctrl-C
            # drained is a clean exit, status 0 for the supervisor, not death by the signal
            # (nor a KeyboardInterrupt traceback from the lifespan task).
            self._captured_signals = [sig for sig in self._captured_signals
                                      if sig not in (signal.SIGTERM, signal.SIGINT)]


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); port 0 picks a free port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.replicas is not None:
        return serve_replicas(args)
    engine_args = EngineArgs.from_cli_args(args)
    try:
        config = engine_args.to_engine_config()
        settings = server_settings_from_args(args)
        connection_settings = connection_settings_from_args(args)
        sock = bind_socket(args.host, args.port)
    except (ValueError, OSError) as error:
        logger.error("cannot start: %s", error)
        return 2
    host, port = sock.getsockname()[:2]
    # Request bodies of megabytes pass through this process's event loop in buffers that
    # glibc would otherwise map and unmap one by one.
    keep_large_buffers_in_heap()

    engine: AsyncLLM | None = None

    def make_engine(observer: RequestStatsObserver) -> AsyncLLM:
        assert engine is not None  # started below, before uvicorn runs the app
        logger.info("serving %s on http://%s:%d (policy %s, %d KV blocks)",
                    settings.served_model_name, host, port, config.scheduler.policy,
                    engine.client.num_kv_blocks)
        freeze_startup_heap()
        return engine

    engine_died = False

    def stop_serving() -> None:
        nonlocal engine_died
        engine_died = True
        server.should_exit = True

    app = build_app(make_engine, settings, on_engine_dead=stop_serving)
    server = DrainingServer(uvicorn.Config(
        app, log_level=args.log_level, timeout_keep_alive=30,
        http=setup_connection_guards(connection_settings),
        timeout_graceful_shutdown=math.ceil(settings.shutdown_timeout_s + DRAIN_MARGIN_S),
    ), on_shutdown=lambda: begin_drain(app))
    # The engine starts before the app, so that a setting the engine core refuses (a model
    # too short for max_model_len, memory that cannot be had) ends with "cannot start"
    # rather than a traceback from the app's start-up.
    try:
        engine = AsyncLLM(config, stats_observer=app.state.metrics)
    except (RuntimeError, ValueError, OSError) as error:
        sock.close()
        logger.error("cannot start: %s", error)
        return 2
    with contextlib.suppress(KeyboardInterrupt):  # re-raised by uvicorn after it shut down
        server.run(sockets=[sock])
    return 0 if server.started and not engine_died else 1
