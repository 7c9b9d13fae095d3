"""`continuum serve`: the OpenAI-compatible HTTP server on uvicorn.

With no arguments it serves the embedded `tiny` model on 127.0.0.1:8000. Engine flags are
those of `EngineArgs`; the server's own flags are below. The process exits with status 1 when
the engine core dies (after answering 503 to what is in flight), for a supervisor to restart.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import socket

import uvicorn

from engine.engine_args import EngineArgs
from engine.entrypoints.openai.api_server import build_app
from engine.entrypoints.openai.serving import (
    DEFAULT_MAX_N,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    DEFAULT_MAX_STOP_STRINGS,
    ServerSettings,
)
from engine.entrypoints.openai.tool_parsers import TOOL_PARSERS
from engine.frontend.async_llm import AsyncLLM
from engine.frontend.stats import RequestStatsObserver

logger = logging.getLogger("continuum.serve")

GRACEFUL_SHUTDOWN_S = 10  # open streams get this long to finish once asked to stop


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1",
                       help="address to bind (default: 127.0.0.1, this machine only)")
    group.add_argument("--port", type=int, default=8000,
                       help="port to bind; 0 picks a free one (default: 8000)")
    group.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    group.add_argument("--served-model-name", default=None,
                       help="the model id clients use (default: the --model value)")
    group.add_argument("--tool-call-parser", default="auto", choices=sorted(TOOL_PARSERS),
                       help="how tool calls are found in output (default: auto = Hermes "
                            "<tool_call> tags, else Llama-3 JSON)")
    group.add_argument("--max-request-body-bytes", type=int,
                       default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                       help="larger request bodies get 413 (default: %(default)s)")
    group.add_argument("--max-prompt-tokens", type=int, default=None,
                       help="longer prompts get 400 (default: up to --max-model-len)")
    group.add_argument("--max-output-tokens", type=int, default=None,
                       help="most tokens one completion may generate; a larger max_tokens gets "
                            "400 (default: up to --max-model-len)")
    group.add_argument("--max-n", type=int, default=DEFAULT_MAX_N,
                       help="most completions per request (n); more get 400 "
                            "(default: %(default)s)")
    group.add_argument("--max-stop-strings", type=int, default=DEFAULT_MAX_STOP_STRINGS,
                       help="most stop strings per request; more get 400 (default: %(default)s)")
    group.add_argument("--max-waiting-requests", type=int, default=None,
                       help="once this many requests wait for the engine, new ones get 429 "
                            "with Retry-After (default: no limit)")
    group.add_argument("--retry-after-s", type=int, default=1,
                       help="the Retry-After of a 429, seconds (default: %(default)s)")
    group.add_argument("--log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug"])
    EngineArgs.add_cli_args(parser)


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
    engine_args = EngineArgs.from_cli_args(args)
    try:
        config = engine_args.to_engine_config()
        settings = ServerSettings(
            served_model_name=args.served_model_name or engine_args.model,
            api_key=args.api_key, max_request_body_bytes=args.max_request_body_bytes,
            tool_call_parser=args.tool_call_parser, max_prompt_tokens=args.max_prompt_tokens,
            max_output_tokens=args.max_output_tokens, max_n=args.max_n,
            max_stop_strings=args.max_stop_strings,
            max_waiting_requests=args.max_waiting_requests, retry_after_s=args.retry_after_s,
        )
        sock = bind_socket(args.host, args.port)
    except (ValueError, OSError) as error:
        logger.error("cannot start: %s", error)
        return 2
    host, port = sock.getsockname()[:2]

    def make_engine(observer: RequestStatsObserver) -> AsyncLLM:
        engine = AsyncLLM(config, stats_observer=observer)
        logger.info("serving %s on http://%s:%d (policy %s, %d KV blocks)",
                    settings.served_model_name, host, port, config.scheduler.policy,
                    engine.client.num_kv_blocks)
        return engine

    engine_died = False

    def stop_serving() -> None:
        nonlocal engine_died
        engine_died = True
        server.should_exit = True

    app = build_app(make_engine, settings, on_engine_dead=stop_serving)
    server = uvicorn.Server(uvicorn.Config(
        app, log_level=args.log_level, timeout_keep_alive=30,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    ))
    with contextlib.suppress(KeyboardInterrupt):  # re-raised by uvicorn after it shut down
        server.run(sockets=[sock])
    return 0 if server.started and not engine_died else 1
