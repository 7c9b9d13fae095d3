"""`python -m lab drain`: how a `continuum serve` subprocess stops on SIGTERM while streams
are in flight, a single server or `--replicas N` on Ray Serve.

It opens `--streams` streamed completions of `--max-tokens` tokens each, waits until every one
has its first token, sends the server SIGTERM, sends one more completion `--probe-after-s`
later, and waits for the server to exit. Figures: seconds from SIGTERM to exit, how each
stream ended (finished, ended by the drain with a `server_shutting_down` error event and
`[DONE]`, another error, or cut off without `[DONE]`) and after how long, and what the late
completion got (a 503, or no connection: a server that stopped accepting). Checks: the server
exited 0 within `--shutdown-timeout-s` plus `STOP_MARGIN_S`, no stream was cut off, and the
late completion was refused: 503, or no connection (a 404 would tell a client that the
path does not exist). Exit status 1 if a check failed.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from lab.flags import add_settings_flags, bench_setting, parse_serve_args, settings_from_args
from lab.server_checks import Check, checks_to_dicts, passed, run_against_server
from lab.server_process import ServerProcess, add_server_arguments

DEFAULT_SERVE_ARGS = ("--model", "tiny", "--max-model-len", "2048", "--shutdown-timeout-s", "3")
# Beyond the drain's timeout: the streams' last events (a single server gives them 5 s), and
# the engine core's or Ray's own stop.
STOP_MARGIN_S = 10.0
FINISHED, SHUTTING_DOWN, CUT = "finished", "server_shutting_down", "cut off"


@dataclass
class StreamEnd:
    """How one stream ended: `kind` (FINISHED, SHUTTING_DOWN, another error's code, or CUT),
    the tokens it received, and seconds from SIGTERM to its end (negative: before it)."""

    kind: str = CUT
    num_tokens: int = 0
    ended_s: float | None = None


@dataclass
class DrainReport:
    """The run's figures and checks (see the module docstring)."""

    num_streams: int
    shutdown_timeout_s: float
    exit_status: int | None
    stop_s: float | None
    streams: list[StreamEnd]
    late_request: str
    checks: tuple[Check, ...] = field(default=())

    @property
    def passed(self) -> bool:
        return passed(self.checks)

    def figures(self) -> list[tuple[str, object]]:
        kinds = Counter(end.kind for end in self.streams)
        ended = [end.ended_s for end in self.streams if end.ended_s is not None]
        return [
            ("streams", self.num_streams),
            ("drain timeout (--shutdown-timeout-s)", f"{self.shutdown_timeout_s:g} s"),
            ("SIGTERM to exit", "did not exit" if self.stop_s is None
             else f"{self.stop_s:.1f} s (status {self.exit_status})"),
            ("streams by how they ended", ", ".join(f"{kind} {count}"
                                                    for kind, count in sorted(kinds.items()))),
            ("last stream ended after SIGTERM", f"{max(ended):.1f} s" if ended else "-"),
            ("tokens received", sum(end.num_tokens for end in self.streams)),
            ("completion sent during the drain", self.late_request),
        ]

    def to_dict(self) -> dict[str, Any]:
        return {"figures": dict(self.figures()), "streams": [asdict(e) for e in self.streams],
                "checks": checks_to_dicts(self.checks)}


@dataclass(frozen=True)
class DrainSettings:
    """The streams in flight at SIGTERM and the late probe."""

    streams: int = bench_setting(4, "streamed completions in flight at SIGTERM")
    max_tokens: int = bench_setting(1900, "tokens each stream asks for, EOS ignored")
    model: str = bench_setting("tiny", "the served model")
    probe_after_s: float = bench_setting(0.5, "one more completion this long after SIGTERM")

    def __post_init__(self) -> None:
        if self.streams < 1 or self.max_tokens < 1 or self.probe_after_s < 0:
            raise ValueError("--streams and --max-tokens must be >= 1, --probe-after-s >= 0")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_flags(parser, DrainSettings)
    parser.add_argument("--json", default=None, help="write the figures here")
    add_server_arguments(parser, DEFAULT_SERVE_ARGS)


def main(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(DrainSettings, args)
        timeout_s = shutdown_timeout_s(shlex.split(args.serve_args))
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return run_against_server(
        args, lambda server: run_drain(server, settings, timeout_s), check_invariants=False,
        context={"streams": settings.streams, "max_tokens": settings.max_tokens})


def shutdown_timeout_s(serve_args: list[str]) -> float:
    """The drain's timeout the server flags set, read by the server's own parser."""
    return float(parse_serve_args(serve_args).shutdown_timeout_s)


def run_drain(server: ServerProcess, settings: DrainSettings,
              timeout_s: float) -> DrainReport:
    """Streams, SIGTERM, a late completion, the exit; the report."""
    body = {"model": settings.model, "prompt": "hello", "max_tokens": settings.max_tokens,
            "ignore_eos": True, "stream": True}
    ends = [StreamEnd() for _ in range(settings.streams)]
    started = threading.Semaphore(0)
    signalled_at: list[float] = []
    threads = [threading.Thread(target=_stream, daemon=True,
                                args=(server.base_url, body, end, started, signalled_at))
               for end in ends]
    for thread in threads:
        thread.start()
    for _ in threads:
        started.acquire(timeout=120)
    signalled_at.append(time.monotonic())
    server_exit: list[int | None] = []
    waiter = threading.Thread(target=lambda: server_exit.append(server.signal_and_wait(
        signal.SIGTERM, timeout_s + STOP_MARGIN_S + 60)))
    waiter.start()
    time.sleep(settings.probe_after_s)
    late = _late_request(server.base_url, settings.model)
    waiter.join()
    stop_s = time.monotonic() - signalled_at[0] if server_exit[0] is not None else None
    for thread in threads:
        thread.join(timeout=30)
    report = DrainReport(settings.streams, timeout_s, server_exit[0], stop_s, ends, late)
    report.checks = _checks(report)
    return report


def _stream(base_url: str, body: dict[str, Any], end: StreamEnd,
            started: threading.Semaphore, signalled_at: list[float]) -> None:
    """Reads one stream to its end into `end`; releases `started` at its first token."""
    last_event: dict[str, Any] = {}
    try:
        with httpx.stream("POST", base_url + "/v1/completions", json=body,
                          timeout=httpx.Timeout(30, read=300)) as response:
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    error = last_event.get("error")
                    end.kind = FINISHED if error is None else str(error.get("code"))
                    break
                if line.startswith("data: "):
                    last_event = json.loads(line.removeprefix("data: "))
                    end.num_tokens += "choices" in last_event
                    if end.num_tokens == 1:
                        started.release()
    except httpx.HTTPError:
        pass
    finally:
        if end.num_tokens == 0:
            started.release()
        if signalled_at:
            end.ended_s = time.monotonic() - signalled_at[0]


def _late_request(base_url: str, model: str) -> str:
    try:
        response = httpx.post(base_url + "/v1/completions", timeout=30, json={
            "model": model, "prompt": "hi", "max_tokens": 2})
    except httpx.HTTPError as error:
        return f"no answer ({type(error).__name__})"
    try:
        code = response.json()["error"]["code"] if response.status_code != 200 else ""
    except (ValueError, KeyError, TypeError):
        code = ""
    return f"{response.status_code} {code or ''}".strip()


def _checks(report: DrainReport) -> tuple[Check, ...]:
    bound_s = report.shutdown_timeout_s + STOP_MARGIN_S
    cut = sum(end.kind == CUT for end in report.streams)
    stop = "no exit" if report.stop_s is None else f"{report.stop_s:.1f} s"
    return (
        Check("exited 0 within the drain timeout + margin",
              report.exit_status == 0 and report.stop_s is not None
              and report.stop_s <= bound_s,
              f"status {report.exit_status} after {stop}, bound {bound_s:g} s"),
        Check("no stream cut off", cut == 0,
              f"{cut} of {report.num_streams} ended without [DONE]"),
        Check("the completion sent during the drain was refused (503, or no connection)",
              report.late_request.startswith(("503", "no answer")), report.late_request),
    )
