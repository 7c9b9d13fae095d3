"""`python -m lab soak`: an agent workload replayed for minutes against a `continuum serve`
subprocess whose core checks its scheduler and KV invariants after every step.

`num_lanes` closed-loop lanes each replay one job after another (the trace's jobs in a
cycle, each run under a fresh job id, with `eval.replay_client`) until `duration_s` has
passed; a monitor polls `/health` and the server's memory meanwhile. A broken invariant
stops the core (an AssertionError in the server's log, then 503 on `/health`), so zero
violations means both stayed clean; a failed health poll ends the run early. Checks:
invariant checks ran and kept running, no violation, no failed job, no leaked KV block, no
pin or job state left, memory growth within the bound. Exit status 1 if a check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import httpx

from eval.replay_client import AgentReplay, ReplaySettings
from eval.workload import AgentJobSpec
from eval.workload_flags import add_workload_arguments, load_workload
from eval.workloads import workload_source
from lab.flags import add_settings_flags, bench_setting, settings_from_args
from lab.load_clients import delete_job, served_model
from lab.server_checks import (
    DEFAULT_MEMORY_BOUND_MIB,
    METRIC,
    Check,
    RssSampler,
    ServerReport,
    run_against_server,
    server_state_checks,
    wait_idle,
)
from lab.server_process import ServerProcess, add_server_arguments, parse_prometheus

# A small pool, so that the lanes' jobs preempt one another and pins are broken under
# pressure; fixed-2s so that the tiny model's turns are pinned at all (see `lab.bench.load`).
DEFAULT_SERVE_ARGS = ("--num-kv-blocks", "128", "--max-model-len", "1024",
                      "--policy-option", "estimator=fixed-2s")
_VIOLATION_MARKER = "AssertionError"


@dataclass(frozen=True)
class SoakSettings:
    """The soak: `num_lanes` lanes replaying jobs for `duration_s` (a job under way at the
    end finishes), tool durations capped at `max_tool_s` (None: as the trace says). The
    memory baseline and the invariant-check count are taken `warmup_s` into the run; the
    monitor samples every `sample_interval_s`."""

    duration_s: float = bench_setting(300.0, "start jobs for this long")
    warmup_s: float = bench_setting(30.0, "memory baseline after this long")
    num_lanes: int = bench_setting(
        16, "jobs replayed at once, one after another per lane", name="lanes")
    max_tool_s: float | None = bench_setting(5.0, "cap on a tool's duration, seconds")
    request_timeout_s: float = 120.0
    sample_interval_s: float = 1.0
    memory_bound_mib: float = bench_setting(
        DEFAULT_MEMORY_BOUND_MIB, "most the server's RSS may grow after warm-up")
    idle_timeout_s: float = 60.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.warmup_s < self.duration_s:
            raise ValueError("need 0 <= warmup_s < duration_s")
        if self.num_lanes < 1 or self.sample_interval_s <= 0 or self.request_timeout_s <= 0:
            raise ValueError("num_lanes >= 1; sample_interval_s, request_timeout_s > 0")
        if self.max_tool_s is not None and self.max_tool_s < 0:
            raise ValueError("max_tool_s must be >= 0")


@dataclass
class SoakTally:
    """What the lanes and the monitor saw; mutated in one event loop."""

    jobs_completed: int = 0
    turns_completed: int = 0
    failed_jobs: int = 0
    first_failures: list[str] = field(default_factory=list)
    health_polls: int = 0
    health_failures: int = 0
    invariant_checks_at_baseline: float | None = None
    baseline_rss_mib: float | None = None
    last_counters: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0

    def record_failure(self, error: str) -> None:
        self.failed_jobs += 1
        if len(self.first_failures) < 5:
            self.first_failures.append(error)


@dataclass(frozen=True)
class SoakReport(ServerReport):
    """The tally, the server's counters over the run, the engine's end state, memory and
    the checks; `passed` if every check did."""

    tally: SoakTally
    counters: dict[str, int]
    invariant_violations: int

    def figures(self) -> list[tuple[str, object]]:
        tally = self.tally
        return [
            ("wall time (s)", f"{tally.wall_s:.1f}"),
            ("jobs completed", tally.jobs_completed),
            ("turns completed", tally.turns_completed),
            ("failed jobs", tally.failed_jobs),
            ("invariant checks (steps)", self.counters["invariant_checks"]),
            ("invariant violations", self.invariant_violations),
            ("health polls / failures", f"{tally.health_polls} / {tally.health_failures}"),
            ("preemptions", self.counters["preemptions"]),
            ("pins created", self.counters["pins_created"]),
            *self.server_rows(),
        ]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self.tally), "wall_s": round(self.tally.wall_s, 2),
                "counters": self.counters,
                "invariant_violations": self.invariant_violations,
                **self.server_dict()}


class _Soak:
    """One soak run's lanes and monitor, against a started server it does not own."""

    def __init__(self, server: ServerProcess, jobs: list[AgentJobSpec],
                 settings: SoakSettings) -> None:
        if not jobs:
            raise ValueError("the soak needs at least one job")
        self.server = server
        self.settings = settings
        self.jobs = fresh_jobs(jobs, settings.max_tool_s)
        self.tally = SoakTally()
        self.sampler = RssSampler(server)
        self.failed_job_ids: list[str] = []
        self._started_s = 0.0
        self._server_failed = False  # set by the monitor: no lane starts another job

    async def run(self) -> SoakTally:
        async with httpx.AsyncClient(base_url=self.server.base_url, timeout=30.0) as http:
            model = await served_model(http)
        # One model lookup for the run, instead of one per replayed job.
        replay = ReplaySettings(base_url=self.server.base_url, model=model,
                                request_timeout_s=self.settings.request_timeout_s,
                                seed=self.settings.seed)
        self._started_s = time.monotonic()
        deadline_s = self._started_s + self.settings.duration_s
        monitor = asyncio.create_task(self._monitor())
        try:
            await asyncio.gather(*(self._lane(deadline_s, lane, replay)
                                   for lane in range(self.settings.num_lanes)))
        finally:
            monitor.cancel()
            await asyncio.gather(monitor, return_exceptions=True)
        async with httpx.AsyncClient(base_url=self.server.base_url, timeout=30.0) as http:
            for job_id in self.failed_job_ids:
                await delete_job(http, job_id)
        self.tally.wall_s = time.monotonic() - self._started_s
        return self.tally

    async def _lane(self, deadline_s: float, lane: int, settings: ReplaySettings) -> None:
        # Lanes start staggered, so their turns do not move in lockstep.
        await asyncio.sleep(lane * self.settings.sample_interval_s / self.settings.num_lanes)
        while time.monotonic() < deadline_s and not self._server_failed:
            job = next(self.jobs)
            replay = AgentReplay([job], [0.0], settings)
            await replay.run()
            record = replay.records[0]
            self.tally.turns_completed += len(record.turns)
            if record.error is None:
                self.tally.jobs_completed += 1
            else:
                self.tally.record_failure(f"{job.job_id}: {record.error}")
                self.failed_job_ids.append(job.job_id)

    async def _monitor(self) -> None:
        tally = self.tally
        async with httpx.AsyncClient(base_url=self.server.base_url, timeout=10.0) as http:
            while True:
                healthy = await _healthy(http)
                tally.health_polls += 1
                tally.health_failures += not healthy
                self._server_failed = self._server_failed or not healthy
                rss_mib = await asyncio.to_thread(self.sampler.sample)
                tally.last_counters = await _scrape_counters(http) or tally.last_counters
                warmed_up = time.monotonic() - self._started_s >= self.settings.warmup_s
                if warmed_up and tally.baseline_rss_mib is None and healthy:
                    tally.baseline_rss_mib = rss_mib
                    tally.invariant_checks_at_baseline = tally.last_counters.get(
                        "invariant_checks")
                await asyncio.sleep(self.settings.sample_interval_s)


def fresh_jobs(jobs: list[AgentJobSpec], max_tool_s: float | None) -> Iterator[AgentJobSpec]:
    """The jobs in an endless cycle, each under a new id, tool durations capped."""
    for number, job in enumerate(itertools.cycle(jobs)):
        turns = tuple(
            turn if max_tool_s is None or turn.tool_duration_s is None
            else replace(turn, tool_duration_s=min(turn.tool_duration_s, max_tool_s))
            for turn in job.turns)
        yield replace(job, job_id=f"soak-{number}-{job.job_id}", turns=turns)


async def _healthy(http: httpx.AsyncClient) -> bool:
    try:
        return (await http.get("/health")).status_code == 200
    except httpx.HTTPError:
        return False


_COUNTER_METRICS = {"invariant_checks": "invariant_checks_total",
                    "preemptions": "num_preemptions_total",
                    "pins_created": "pins_created_total", "engine_steps": "engine_steps_total"}


def _counters_of(samples: dict[str, float]) -> dict[str, float]:
    return {name: samples.get(METRIC + metric, 0.0) for name, metric in _COUNTER_METRICS.items()}


async def _scrape_counters(http: httpx.AsyncClient) -> dict[str, float] | None:
    """The soak's counters from `/metrics`; None if the server did not answer."""
    try:
        response = await http.get("/metrics")
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return _counters_of(parse_prometheus(response.text))


def run_soak(server: ServerProcess, jobs: list[AgentJobSpec],
             settings: SoakSettings) -> SoakReport:
    """Runs the soak against a started `server` (with `--debug-check-invariants`). A server
    that died during the run (it exits when its core does) fails the checks instead of
    raising."""
    start_rss_mib = server.rss_mib()
    before = _counters_of(server.metrics())
    soak = _Soak(server, jobs, settings)
    tally = asyncio.run(soak.run())
    end_state = wait_idle(server, timeout_s=settings.idle_timeout_s)
    try:
        after = _counters_of(server.metrics())
    except httpx.HTTPError:
        after = tally.last_counters or before
    counters = {name: round(after[name] - before[name]) for name in _COUNTER_METRICS}
    memory = soak.sampler.memory(
        start_rss_mib=start_rss_mib, baseline_rss_mib=tally.baseline_rss_mib or start_rss_mib,
        bound_mib=settings.memory_bound_mib)
    violations = server.log_text().count(_VIOLATION_MARKER)
    healthy = server.is_healthy()
    checks = (
        _invariant_checks_ran(tally, after["invariant_checks"], counters["invariant_checks"]),
        Check("no invariant violation",
              violations == 0 and tally.health_failures == 0 and healthy,
              f"{violations} AssertionError in the server log, {tally.health_failures} of "
              f"{tally.health_polls} health polls failed, healthy at the end: {healthy}"),
        Check("no failed job", tally.failed_jobs == 0 and tally.jobs_completed > 0,
              f"{tally.failed_jobs} failed, {tally.jobs_completed} completed; first: "
              f"{tally.first_failures or 'none'}"),
        *server_state_checks(end_state, memory),
    )
    return SoakReport(end_state=end_state, memory=memory, checks=checks, tally=tally,
                      counters=counters, invariant_violations=violations)


def _invariant_checks_ran(tally: SoakTally, end_count: float, run_count: int) -> Check:
    at_baseline = tally.invariant_checks_at_baseline
    grew = at_baseline is not None and end_count > at_baseline
    return Check("invariant checks ran throughout", run_count > 0 and grew,
                 f"{run_count} checks in the run; {at_baseline} at the baseline, "
                 f"{end_count:.0f} at the end")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    add_settings_flags(parser, SoakSettings)
    add_server_arguments(parser, DEFAULT_SERVE_ARGS)
    parser.add_argument("--json", default=None, help="write the figures and checks here")


def main(args: argparse.Namespace) -> int:
    try:
        jobs = load_workload(args)
        settings = settings_from_args(SoakSettings, args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    context = {"trace": workload_source(args).label, "num_jobs": len(jobs),
               "settings": asdict(settings)}
    return run_against_server(args, lambda server: run_soak(server, jobs, settings),
                              check_invariants=True, context=context)
