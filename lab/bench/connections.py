"""`python -m lab connections`: slow and many clients against a `continuum serve`
subprocess.

It opens `num_silent` connections that send nothing and `num_trickling` ones that send a
request one byte per `trickle_interval_s`, and keeps reading each until the server closes it
(or `wait_s` has passed). Meanwhile, from another thread, a prober polls `/health` every
`probe_interval_s` both on a fresh connection each time and on one kept-alive connection,
a normal client sends completions one after another on a kept-alive connection, and the
server's descriptors and memory are sampled from `/proc`.

Figures: sockets opened, closed by the server and how (408, 503, no answer), time to close,
latency and status of the probes and completions, server descriptors and RSS before, peak
and after, log lines written. Checks: every slow socket was closed by the server, the
server's descriptors came back to their count before, the kept-alive `/health` always
answered 200 within a second, every completion succeeded, no descriptor-exhaustion message
was logged more than a few times, no KV block leaked. Exit status 1 if a check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import re
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import httpx

from engine.entrypoints.connections import raise_open_file_limit
from eval.replay_metrics import percentile
from lab.flags import add_settings_flags, bench_setting, settings_from_args
from lab.server_checks import (
    Check,
    EngineEndState,
    checks_to_dicts,
    end_state_checks,
    end_state_dict,
    end_state_rows,
    passed,
    run_against_server,
    wait_idle,
)
from lab.server_process import ServerProcess, add_server_arguments

# Without job inference: the end-state check counts job states, and the probes' inferred
# jobs would stay for --job-inference-max-age-s.
DEFAULT_SERVE_ARGS = ("--num-kv-blocks", "512", "--max-model-len", "1024", "--no-job-inference")
SILENT, TRICKLING = "silent", "trickling"
# A request line and headers that never end: every byte sent is a valid header byte.
_TRICKLED_REQUEST = b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Slow: " + b"a" * 100_000
_STATUS_LINE = re.compile(rb"^HTTP/1\.[01] (\d{3}) ")
_ACCESS_LOG_LINE = re.compile(r'" \d{3}( |$)')
_EXHAUSTION_MARKERS = ("Too many open files", "out of system resource")
_DESCRIPTORS_KEPT_BY_THE_CLIENT = 64


@dataclass(frozen=True)
class SlowClientSettings:
    """The slow clients (counts of connections; seconds), the probes, and how long to wait
    for the server to close the slow connections."""

    num_silent: int = bench_setting(3000, "connections that send nothing", name="silent")
    num_trickling: int = bench_setting(
        500, "connections that send a request one byte at a time", name="trickling")
    trickle_interval_s: float = bench_setting(1.0, "seconds between a trickling connection's bytes")
    wait_s: float = bench_setting(
        60.0, "most seconds to wait for the server to close the slow connections")
    probe_interval_s: float = 0.1
    max_tokens: int = bench_setting(16, "tokens of each probe completion")
    max_concurrent_connects: int = 200
    model: str = "tiny"

    def __post_init__(self) -> None:
        if self.num_silent < 0 or self.num_trickling < 0:
            raise ValueError("the numbers of connections must be >= 0")
        if min(self.trickle_interval_s, self.wait_s, self.probe_interval_s) <= 0:
            raise ValueError("intervals and wait_s must be positive")
        if self.max_tokens < 1 or self.max_concurrent_connects < 1:
            raise ValueError("max_tokens and max_concurrent_connects must be >= 1")


@dataclass
class SocketOutcome:
    """One slow connection: when it was opened and closed by the server (monotonic s; None
    if still open at the end), the status the server answered (None for none)."""

    kind: str
    opened_s: float
    closed_s: float | None = None
    status: int | None = None

    @property
    def lifetime_s(self) -> float | None:
        return None if self.closed_s is None else self.closed_s - self.opened_s


@dataclass
class ProbeTally:
    """Latencies (s) of answered requests, their statuses, and failures by exception name."""

    latencies_s: list[float] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)

    @property
    def num_not_ok(self) -> int:
        return sum(n for status, n in self.statuses.items() if status != 200)

    def summary(self) -> str:
        p50, top = percentile(self.latencies_s, 50), max(self.latencies_s, default=None)
        statuses = ", ".join(f"{s}: {n}" for s, n in sorted(self.statuses.items())) or "none"
        errors = ", ".join(f"{e}: {n}" for e, n in sorted(self.errors.items())) or "none"
        latency = "n/a" if p50 is None or top is None else f"{p50:.3f} / {top:.3f}"
        return f"p50 / max {latency} s; statuses {statuses}; errors {errors}"

    def to_dict(self) -> dict[str, Any]:
        return {"num": len(self.latencies_s) + sum(self.errors.values()),
                "p50_s": percentile(self.latencies_s, 50),
                "max_s": max(self.latencies_s, default=None),
                "statuses": dict(self.statuses), "errors": dict(self.errors)}


@dataclass
class ServerSamples:
    """The server process's descriptors and RSS (MiB, with its descendants) over the run."""

    fds: list[int] = field(default_factory=list)
    rss_mib: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class ConnectionsReport:
    """What a run measured, and its checks."""

    settings: SlowClientSettings
    outcomes: tuple[SocketOutcome, ...]
    connect_errors: dict[str, int]
    fresh_health: ProbeTally
    kept_health: ProbeTally
    completions: ProbeTally
    fds_before: int
    fds_after: int
    rss_before_mib: float
    rss_after_mib: float
    samples: ServerSamples
    log_lines: int
    exhaustion_lines: int
    wall_s: float
    end_state: EngineEndState | None
    checks: tuple[Check, ...]

    @property
    def passed(self) -> bool:
        return passed(self.checks)

    @property
    def num_still_open(self) -> int:
        """Slow sockets the server had not closed by the end of the run."""
        return sum(o.closed_s is None for o in self.outcomes)

    def _closed(self, kind: str, status: int | None) -> list[float]:
        return [o.lifetime_s for o in self.outcomes
                if o.kind == kind and o.status == status and o.lifetime_s is not None]

    def figures(self) -> list[tuple[str, object]]:
        counts = Counter((o.kind, o.status) for o in self.outcomes if o.closed_s is not None)
        still_open = self.num_still_open
        rows: list[tuple[str, object]] = [
            ("slow sockets opened (silent + trickling)",
             f"{sum(o.kind == SILENT for o in self.outcomes)} + "
             f"{sum(o.kind == TRICKLING for o in self.outcomes)}"),
            ("connect errors", _counts(self.connect_errors)),
            ("closed by the server", len(self.outcomes) - still_open),
            ("still open at the end", still_open),
        ]
        for (kind, status), num in sorted(counts.items(), key=lambda item: str(item[0])):
            lifetimes = self._closed(kind, status)
            answer = "no answer" if status is None else str(status)
            rows.append((f"{kind}, {answer}: count; time to close p50 / max (s)",
                         f"{num}; {_p50_max(lifetimes)}"))
        rows += [
            ("/health, fresh connection each", self.fresh_health.summary()),
            ("/health, kept-alive connection", self.kept_health.summary()),
            (f"completions ({self.settings.max_tokens} tokens, kept-alive)",
             self.completions.summary()),
            ("server fds before / peak / after",
             f"{self.fds_before} / {max(self.samples.fds, default=0)} / {self.fds_after}"),
            ("server RSS before / peak / after (MiB)",
             f"{self.rss_before_mib:.1f} / {max(self.samples.rss_mib, default=0.0):.1f} / "
             f"{self.rss_after_mib:.1f}"),
            ("server log lines written (not access log)", self.log_lines),
            ("of which about descriptor exhaustion", self.exhaustion_lines),
            ("wall time (s)", f"{self.wall_s:.1f}"),
            *end_state_rows(self.end_state),
        ]
        return rows

    def to_dict(self) -> dict[str, Any]:
        return {
            "outcomes": Counter(f"{o.kind} {o.status}" for o in self.outcomes
                                if o.closed_s is not None),
            "still_open": self.num_still_open,
            "connect_errors": self.connect_errors,
            "fresh_health": self.fresh_health.to_dict(),
            "kept_health": self.kept_health.to_dict(),
            "completions": self.completions.to_dict(),
            "fds": {"before": self.fds_before, "peak": max(self.samples.fds, default=0),
                    "after": self.fds_after},
            "rss_mib": {"before": self.rss_before_mib, "after": self.rss_after_mib,
                        "peak": max(self.samples.rss_mib, default=0.0)},
            "log_lines": self.log_lines, "exhaustion_lines": self.exhaustion_lines,
            "wall_s": self.wall_s, "end_state": end_state_dict(self.end_state),
            "checks": checks_to_dicts(self.checks), "passed": self.passed,
        }


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{name} {num}" for name, num in sorted(counts.items())) or "none"


def _p50_max(values: list[float]) -> str:
    p50 = percentile(values, 50)
    return "n/a" if p50 is None else f"{p50:.2f} / {max(values):.2f}"


class _SlowClients:
    """The slow connections of one run, in the caller's event loop."""

    def __init__(self, host: str, port: int, settings: SlowClientSettings) -> None:
        self.address = (host, port)
        self.settings = settings
        self.outcomes: list[SocketOutcome] = []
        self.connect_errors: Counter[str] = Counter()
        self._connects = asyncio.Semaphore(settings.max_concurrent_connects)

    async def run(self) -> None:
        kinds = [SILENT] * self.settings.num_silent + [TRICKLING] * self.settings.num_trickling
        deadline_s = time.monotonic() + self.settings.wait_s
        await asyncio.gather(*(self._hold(kind, deadline_s) for kind in kinds))

    async def _hold(self, kind: str, deadline_s: float) -> None:
        async with self._connects:
            try:
                reader, writer = await asyncio.open_connection(*self.address)
            except OSError as error:
                self.connect_errors[errno.errorcode.get(error.errno or 0, repr(error))] += 1
                return
        outcome = SocketOutcome(kind, time.monotonic())
        self.outcomes.append(outcome)
        trickler = asyncio.create_task(self._trickle(writer)) if kind == TRICKLING else None
        try:
            data = await asyncio.wait_for(self._read_to_close(reader),
                                          max(0.0, deadline_s - time.monotonic()))
            outcome.closed_s = time.monotonic()
            match = _STATUS_LINE.match(data)
            outcome.status = int(match.group(1)) if match else None
        except asyncio.TimeoutError:
            pass
        finally:
            if trickler is not None:
                trickler.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await trickler
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    @staticmethod
    async def _read_to_close(reader: asyncio.StreamReader) -> bytes:
        data = b""
        with contextlib.suppress(ConnectionError):
            while chunk := await reader.read(65536):
                data += chunk
        return data

    async def _trickle(self, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            for byte in _TRICKLED_REQUEST:
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(self.settings.trickle_interval_s)


class _Prober:
    """The probes and the /proc sampler, in their own thread and event loop, so that the
    slow connections' loop does not delay them; owned by one run."""

    def __init__(self, server: ServerProcess, settings: SlowClientSettings) -> None:
        self.server = server
        self.settings = settings
        self.fresh_health = ProbeTally()
        self.kept_health = ProbeTally()
        self.completions = ProbeTally()
        self.samples = ServerSamples()
        self.ready = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> None:
        self._thread.start()
        if not self.ready.wait(60.0):
            raise RuntimeError("the probes did not start within 60 s (is the server up?)")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    async def _run(self) -> None:
        fresh = httpx.AsyncClient(base_url=self.server.base_url, timeout=30.0,
                                  limits=httpx.Limits(max_keepalive_connections=0))
        kept = httpx.AsyncClient(base_url=self.server.base_url, timeout=30.0)
        generate = httpx.AsyncClient(base_url=self.server.base_url, timeout=120.0)
        async with fresh, kept, generate:
            # Open the kept-alive connections before the slow clients come.
            (await kept.get("/health")).raise_for_status()
            body = {"model": self.settings.model, "prompt": "hello", "max_tokens": 1}
            (await generate.post("/v1/completions", json=body)).raise_for_status()
            self.ready.set()
            await asyncio.gather(self._poll(fresh, self.fresh_health),
                                 self._poll(kept, self.kept_health),
                                 self._complete(generate), self._sample())

    async def _request(self, request: Any, tally: ProbeTally) -> None:
        started_s = time.monotonic()
        try:
            response = await request
        except httpx.HTTPError as error:
            tally.errors[type(error).__name__] += 1
            return
        tally.latencies_s.append(time.monotonic() - started_s)
        tally.statuses[response.status_code] += 1

    async def _poll(self, http: httpx.AsyncClient, tally: ProbeTally) -> None:
        while not self._stop.is_set():
            await self._request(http.get("/health"), tally)
            await asyncio.sleep(self.settings.probe_interval_s)

    async def _complete(self, http: httpx.AsyncClient) -> None:
        body = {"model": self.settings.model, "prompt": "The quick brown fox",
                "max_tokens": self.settings.max_tokens, "ignore_eos": True}
        while not self._stop.is_set():
            await self._request(http.post("/v1/completions", json=body), self.completions)

    async def _sample(self) -> None:
        while not self._stop.is_set():
            self.samples.fds.append(self.server.num_fds())
            self.samples.rss_mib.append(self.server.rss_mib())
            await asyncio.sleep(0.5)


def _log_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if not _ACCESS_LOG_LINE.search(line)]


def run_slow_clients(server: ServerProcess, settings: SlowClientSettings) -> ConnectionsReport:
    """Runs the slow clients and the probes against a started `server` it does not own."""
    num_sockets = settings.num_silent + settings.num_trickling
    limit = raise_open_file_limit(num_sockets + _DESCRIPTORS_KEPT_BY_THE_CLIENT)
    if limit < num_sockets + _DESCRIPTORS_KEPT_BY_THE_CLIENT:
        print(f"warning: this client may open only {limit} descriptors; expect connect "
              f"errors (EMFILE) beyond that", file=sys.stderr)
    host, port = server.address
    fds_before, rss_before_mib = server.num_fds(), server.rss_mib()
    log_before = len(server.log_text())
    prober = _Prober(server, settings)
    started_s = time.monotonic()
    prober.start()
    clients = _SlowClients(host, port, settings)
    try:
        time.sleep(1.0)  # probe latencies before the slow clients come
        asyncio.run(clients.run())
        time.sleep(1.0)
    finally:
        prober.stop()
    wall_s = time.monotonic() - started_s
    end_state = wait_idle(server, timeout_s=60.0)
    fds_after = server.num_fds()
    deadline_s = time.monotonic() + 5.0  # the server's loop may still be closing some
    while fds_after > fds_before and time.monotonic() < deadline_s:
        time.sleep(0.1)
        fds_after = server.num_fds()
    rss_after_mib = server.rss_mib()
    lines = _log_lines(server.log_text()[log_before:])
    exhaustion = sum(any(marker in line for marker in _EXHAUSTION_MARKERS) for line in lines)
    report = ConnectionsReport(
        settings=settings, outcomes=tuple(clients.outcomes),
        connect_errors=dict(clients.connect_errors), fresh_health=prober.fresh_health,
        kept_health=prober.kept_health, completions=prober.completions,
        fds_before=fds_before, fds_after=fds_after, rss_before_mib=rss_before_mib,
        rss_after_mib=rss_after_mib, samples=prober.samples, log_lines=len(lines),
        exhaustion_lines=exhaustion, wall_s=wall_s, end_state=end_state, checks=())
    return replace(report, checks=(*_checks(report), *end_state_checks(end_state)))


def _checks(report: ConnectionsReport) -> list[Check]:
    still_open = report.num_still_open
    kept = report.kept_health
    top = max(kept.latencies_s, default=float("inf"))
    completions = report.completions
    return [
        Check("every slow socket closed by the server",
              still_open == 0 and bool(report.outcomes),
              f"{still_open} of {len(report.outcomes)} still open"),
        Check("server descriptors back to before", report.fds_after <= report.fds_before,
              f"{report.fds_before} -> {report.fds_after}"),
        Check("kept-alive /health: 200 within 1 s", not kept.errors and not kept.num_not_ok
              and top < 1.0, kept.summary()),
        Check("completions all succeeded", bool(completions.latencies_s)
              and not completions.errors and not completions.num_not_ok, completions.summary()),
        Check("no log flood", report.exhaustion_lines <= 10,
              f"{report.exhaustion_lines} lines about descriptor exhaustion, "
              f"{report.log_lines} non-access lines in all"),
    ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_flags(parser, SlowClientSettings)
    add_server_arguments(parser, DEFAULT_SERVE_ARGS)
    parser.add_argument("--json", default=None, help="write the figures and checks here")


def main(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(SlowClientSettings, args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return run_against_server(args, lambda server: run_slow_clients(server, settings),
                              check_invariants=False, context={"settings": asdict(settings)})
