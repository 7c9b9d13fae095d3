"""`continuum serve --replicas N`: the server as N engine replicas on Ray Serve.

Starts (or, with `--address`, joins) a Ray cluster, runs `engine.replicas.ray_app` there with
Ray Serve's HTTP proxy on `--host`/`--port`, and keeps it up until SIGINT or SIGTERM, when it
drains the replicas (as SIGTERM drains a single server: `--shutdown-timeout-s`) and shuts
the application down. Ray is an optional dependency (`pip install
'continuum-engine[ray]'`); every node of a cluster needs the package installed.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading

from engine.engine_args import EngineArgs
from engine.entrypoints.server_args import server_settings_from_args

logger = logging.getLogger("continuum.replicas")

APP_NAME = "continuum"


def main(args: argparse.Namespace) -> int:
    try:
        import ray
        from ray import serve

        from engine.replicas.ray_app import (
            build_application,
            settings_from_args,
            stop_application,
        )
    except ImportError as error:
        logger.error("--replicas needs Ray Serve: pip install 'continuum-engine[ray]' (%s)",
                     error)
        return 2

    try:
        if args.port == 0:
            raise ValueError("--replicas needs a fixed --port (Ray Serve's proxy binds it)")
        EngineArgs.from_cli_args(args).to_engine_config()
        server_settings_from_args(args)
        settings = settings_from_args(args)
    except ValueError as error:
        logger.error("cannot start: %s", error)
        return 2
    ray.init(address=args.address, include_dashboard=False, logging_level=logging.WARNING)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_application(settings), name=APP_NAME, route_prefix="/")
        logger.info("serving %s on http://%s:%d with %d replicas (%s routing)",
                    args.served_model_name or args.model, args.host, args.port,
                    args.replicas, args.router)
        stop.wait()
        stop_application(APP_NAME, args.shutdown_timeout_s)
    finally:
        serve.delete(APP_NAME)  # nothing left to delete after a drained stop
        ray.shutdown()
    return 0
