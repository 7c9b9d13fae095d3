"""The checks run on a `continuum serve` subprocess once a load's clients are done (`bench
load`, `soak`, `connections`): the engine's end state (idle, every KV block free, no pins, no
job state), the server's memory growth, and a pass/fail list of checks with a short markdown
rendering; `run_against_server`, the harness of every bench that drives a server, starts a
server for each run and reports them.

The runs own their `ServerProcess`; the checks only read it (`/metrics`, `/proc`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx

from lab.server_process import ServerProcess, server_from_args

DEFAULT_MEMORY_BOUND_MIB = 64.0
METRIC = "continuum:"


@dataclass(frozen=True)
class Check:
    """One pass/fail criterion of a run, with the figures that decided it."""

    name: str
    passed: bool
    detail: str


@dataclass(frozen=True)
class EngineEndState:
    """The engine after a run, read from `/metrics` once it went idle (or gave up waiting:
    `idle` False). Free blocks include prefix-cached ones, which any request may evict.
    `pins_created` counts since the server started."""

    idle: bool
    num_running: int
    num_waiting: int
    total_blocks: int
    free_blocks: int
    num_pins: int
    pinned_blocks: int
    num_jobs: int
    pins_created: int = 0

    @property
    def leaked_blocks(self) -> int:
        return self.total_blocks - self.free_blocks

    @classmethod
    def from_metrics(cls, samples: dict[str, float], *, idle: bool) -> EngineEndState:
        def value(name: str) -> int:
            return round(samples.get(METRIC + name, 0.0))

        return cls(idle=idle, num_running=value("num_requests_running"),
                   num_waiting=value("num_requests_waiting"),
                   total_blocks=value("kv_cache_total_blocks"),
                   free_blocks=value("kv_cache_free_blocks"), num_pins=value("num_pins"),
                   pinned_blocks=value("pinned_blocks"), num_jobs=value("num_jobs"),
                   pins_created=value("pins_created_total"))

    def checks(self) -> list[Check]:
        """Idle, no leaked block, no pin, no job state left."""
        return [
            Check("engine idle", self.idle,
                  f"running {self.num_running}, waiting {self.num_waiting}"),
            Check("no leaked KV blocks", self.leaked_blocks == 0 and self.total_blocks > 0,
                  f"{self.leaked_blocks} of {self.total_blocks} blocks not free"),
            Check("no pins left", self.num_pins == 0 and self.pinned_blocks == 0,
                  f"{self.num_pins} pins holding {self.pinned_blocks} blocks"),
            Check("no job state left", self.num_jobs == 0, f"{self.num_jobs} jobs"),
        ]


def wait_idle(server: ServerProcess, *, timeout_s: float = 60.0,
              stable_s: float = 1.0) -> EngineEndState | None:
    """Polls `/metrics` until nothing has run or waited for `stable_s` (a request a client
    abandoned may still be on its way to the core), at most `timeout_s`; None if the server
    stopped answering (it exits when its engine core dies)."""
    deadline_s = time.monotonic() + timeout_s
    idle_since_s: float | None = None
    while True:
        try:
            samples = server.metrics()
        except httpx.HTTPError:
            return None
        now_s = time.monotonic()
        busy = (samples.get(METRIC + "num_requests_running", 0.0)
                + samples.get(METRIC + "num_requests_waiting", 0.0)) > 0
        if busy:
            idle_since_s = None
        elif idle_since_s is None:
            idle_since_s = now_s
        if idle_since_s is not None and now_s - idle_since_s >= stable_s:
            return EngineEndState.from_metrics(samples, idle=True)
        if now_s > deadline_s:
            return EngineEndState.from_metrics(samples, idle=False)
        time.sleep(0.1)


def end_state_checks(state: EngineEndState | None) -> list[Check]:
    """The end state's checks; one failed check if the server no longer answered."""
    if state is None:
        return [Check("server answers after the run", False, "GET /metrics failed")]
    return state.checks()


@dataclass(frozen=True)
class MemoryFigures:
    """Resident memory of the server and its engine core, MiB: at start, after the warm-up
    (the baseline), at the end (engine idle), and the peak sampled during the run. Growth is
    end minus baseline; `bound_mib` is the most it may be."""

    start_rss_mib: float
    baseline_rss_mib: float
    end_rss_mib: float
    peak_rss_mib: float
    bound_mib: float

    @property
    def growth_mib(self) -> float:
        return self.end_rss_mib - self.baseline_rss_mib

    def check(self) -> Check:
        return Check("memory growth within bound", self.growth_mib <= self.bound_mib,
                     f"{self.growth_mib:+.1f} MiB (bound {self.bound_mib:.0f} MiB; "
                     f"{self.baseline_rss_mib:.1f} -> {self.end_rss_mib:.1f} MiB)")

    def to_dict(self) -> dict[str, float]:
        return {"start_rss_mib": round(self.start_rss_mib, 1),
                "baseline_rss_mib": round(self.baseline_rss_mib, 1),
                "end_rss_mib": round(self.end_rss_mib, 1),
                "peak_rss_mib": round(self.peak_rss_mib, 1),
                "growth_mib": round(self.growth_mib, 1), "bound_mib": self.bound_mib}


class RssSampler:
    """Samples the server's resident memory every `interval_s` while running as a task, to
    find the peak; owned by one run. `measure` reads it in MiB (default: the server and its
    descendants, `ServerProcess.rss_mib`)."""

    def __init__(self, server: ServerProcess, interval_s: float = 0.5,
                 measure: Callable[[], float] | None = None) -> None:
        self.server = server
        self.interval_s = interval_s
        self.measure = server.rss_mib if measure is None else measure
        self.peak_rss_mib = 0.0
        self._task: asyncio.Task[None] | None = None

    def sample(self) -> float:
        rss_mib = self.measure()
        self.peak_rss_mib = max(self.peak_rss_mib, rss_mib)
        return rss_mib

    def memory(self, *, start_rss_mib: float, baseline_rss_mib: float,
               bound_mib: float) -> MemoryFigures | None:
        """The run's memory figures, ending now, with the peak sampled so far; None if the
        server process has exited."""
        if not self.server.is_running():
            return None
        return MemoryFigures(start_rss_mib=start_rss_mib, baseline_rss_mib=baseline_rss_mib,
                             end_rss_mib=self.sample(), peak_rss_mib=self.peak_rss_mib,
                             bound_mib=bound_mib)

    async def _run(self) -> None:
        while True:
            await asyncio.to_thread(self.sample)
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


def memory_check(memory: MemoryFigures | None) -> Check:
    if memory is None:
        return Check("memory growth within bound", False, "the server process exited")
    return memory.check()


def end_state_dict(state: EngineEndState | None) -> dict[str, object] | None:
    if state is None:
        return None
    return {**asdict(state), "leaked_blocks": state.leaked_blocks}


def memory_rows(memory: MemoryFigures | None) -> list[tuple[str, object]]:
    """Figures rows for the memory of a run ("n/a" once the server exited)."""
    if memory is None:
        return [("RSS baseline -> end (MiB)", "n/a (the server exited)")]
    return [("RSS start / baseline / end (MiB)",
             f"{memory.start_rss_mib:.1f} / {memory.baseline_rss_mib:.1f} / "
             f"{memory.end_rss_mib:.1f}"),
            ("RSS growth after warm-up (MiB)",
             f"{memory.growth_mib:+.1f} (bound {memory.bound_mib:.0f})"),
            ("RSS peak (MiB)", f"{memory.peak_rss_mib:.1f}")]


def end_state_rows(state: EngineEndState | None) -> list[tuple[str, object]]:
    if state is None:
        return [("leaked KV blocks", "n/a (the server stopped answering)")]
    return [("leaked KV blocks", f"{state.leaked_blocks} of {state.total_blocks}"),
            ("pins left", state.num_pins), ("job states left", state.num_jobs)]


def passed(checks: Sequence[Check]) -> bool:
    return bool(checks) and all(check.passed for check in checks)


def checks_to_dicts(checks: Sequence[Check]) -> list[dict[str, object]]:
    return [{"name": c.name, "passed": c.passed, "detail": c.detail} for c in checks]


def markdown_figures(rows: Sequence[tuple[str, object]], checks: Sequence[Check]) -> str:
    """A two-column table of figures, then one of checks (PASS/FAIL with their details)."""
    lines = ["| figure | value |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in rows]
    lines += ["", "| check | result | detail |", "|---|---|---|"]
    lines += [f"| {c.name} | {'PASS' if c.passed else 'FAIL'} | {c.detail} |" for c in checks]
    return "\n".join(lines)


def server_state_checks(state: EngineEndState | None,
                        memory: MemoryFigures | None) -> list[Check]:
    """The end state's checks, then the memory check."""
    return [*end_state_checks(state), memory_check(memory)]


@dataclass(frozen=True)
class ServerReport:
    """What the reports of `python -m lab load` and `python -m lab soak` (its subclasses) say of
    their server: the engine's end state (None: the server stopped answering), its memory (None:
    its process exited), and the run's checks; `passed` if every check did."""

    end_state: EngineEndState | None
    memory: MemoryFigures | None
    checks: tuple[Check, ...]

    @property
    def passed(self) -> bool:
        return passed(self.checks)

    def server_rows(self) -> list[tuple[str, object]]:
        """Figures rows of the end state and the memory."""
        return [*end_state_rows(self.end_state), *memory_rows(self.memory)]

    def server_dict(self) -> dict[str, Any]:
        """The end state, the memory and the checks as fields of the report's JSON."""
        return {"end_state": end_state_dict(self.end_state),
                "memory": None if self.memory is None else self.memory.to_dict(),
                "checks": checks_to_dicts(self.checks), "passed": self.passed}


class CheckedReport(Protocol):
    """What a run against a server prints and writes: its figures and its checks."""

    checks: tuple[Check, ...]

    @property
    def passed(self) -> bool: ...

    def figures(self) -> list[tuple[str, object]]: ...

    def to_dict(self) -> dict[str, Any]: ...


Run = Callable[[ServerProcess], CheckedReport]


@dataclass(frozen=True)
class FiguresReport:
    """A run's figures and checks as rows (a `CheckedReport`); also several runs' together."""

    rows: tuple[tuple[str, object], ...]
    checks: tuple[Check, ...]

    @property
    def passed(self) -> bool:
        return passed(self.checks)

    def figures(self) -> list[tuple[str, object]]:
        return list(self.rows)

    def to_dict(self) -> dict[str, Any]:
        return {"figures": dict(self.rows), "checks": checks_to_dicts(self.checks),
                "passed": self.passed}


def run_against_server(
    args: argparse.Namespace, runs: Run | Sequence[Run], *,
    check_invariants: bool, context: dict[str, Any],
) -> int:
    """The harness of every bench that drives a server: starts a server for each of `runs`
    (one after another, each its own) with the command's `--serve-args`
    (`add_server_arguments`; `--debug-check-invariants` added if `check_invariants`), stops
    it, prints the report (several runs' together, `FiguresReport`; a failed one's server log
    tail), writes `context` and the report to `--json`; the command's exit status: 2 if the
    server flags are refused, 0 if every check passed, 1 otherwise or if a server did not
    start."""
    try:
        server_from_args(args, check_invariants=check_invariants)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    reports = []
    for run in [runs] if callable(runs) else runs:
        server = server_from_args(args, check_invariants=check_invariants)
        try:
            server.start()
        except RuntimeError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        try:
            reports.append(run(server))
            log_tail = "" if reports[-1].passed else server.log_tail()
        finally:
            server.stop()
        if log_tail:
            print(f"server log (last lines):\n{log_tail}\n", file=sys.stderr)
    report = reports[0] if len(reports) == 1 else FiguresReport(
        tuple(row for each in reports for row in each.figures()),
        tuple(check for each in reports for check in each.checks))
    print(markdown_figures(report.figures(), report.checks))
    if args.json:
        document = {"serve_args": list(server.spec.serve_args), **context, **report.to_dict()}
        Path(args.json).write_text(json.dumps(document, indent=1) + "\n")
    return 0 if report.passed else 1
