"""`python -m lab load`: the load test against a `continuum serve` subprocess.

It starts the server on a free loopback port, sends a seeded probe request, runs a warm-up
phase, takes the memory baseline, runs the measured phase (`lab.load_clients`), waits for the
engine to go idle, and checks: no unexpected errors (429s are counted as rejected, not as
errors), no leaked KV block, no pin or job state left, memory growth within the bound, the
server still healthy, and the probe answered exactly as before the load. Exit status 1 if a
check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from lab.flags import add_settings_flags, bench_setting, settings_from_args
from lab.load_clients import LoadGenerator, LoadSettings, LoadTally, served_model
from lab.server_checks import (
    DEFAULT_MEMORY_BOUND_MIB,
    Check,
    EngineEndState,
    RssSampler,
    ServerReport,
    run_against_server,
    server_state_checks,
    wait_idle,
)
from lab.server_process import ServerProcess, add_server_arguments

# Pins on the tiny model: Eq. 2 prices rebuilding its short contexts near zero and would pin
# nothing; the release's 2 s rule pins every non-final turn, so pins are exercised. Without
# job inference, since the end-state check counts job states and the inferred jobs of the
# job-less clients would stay for --job-inference-max-age-s.
DEFAULT_SERVE_ARGS = ("--num-kv-blocks", "512", "--max-model-len", "1024",
                      "--policy-option", "estimator=fixed-2s", "--no-job-inference")
_PROBE = {"prompt": "The quick brown fox jumps over the lazy dog. Probe.", "max_tokens": 16,
          "min_tokens": 16, "ignore_eos": True, "temperature": 1.0, "seed": 1234,
          "return_token_ids": True}


@dataclass(frozen=True)
class LoadTestSettings:
    """The load test: the measured phase's `load`, a warm-up phase of `warmup_requests`
    with the same clients before the memory baseline, and the bound on memory growth.

    The default warm-up is twice the clients: a shorter one never reaches the measured
    phase's peak concurrency, and the server's allocators then grow to the new high-water
    mark after the baseline (measured: +16 to +18 MiB after 200 warm-up requests for 400
    clients, +6 MiB after 800)."""

    load: LoadSettings = field(default_factory=LoadSettings)
    warmup_requests: int | None = bench_setting(
        None, "requests before the memory baseline", default_text="twice the clients")
    memory_bound_mib: float = bench_setting(
        DEFAULT_MEMORY_BOUND_MIB, "most the server's RSS may grow after warm-up")
    idle_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.warmup_requests is not None and self.warmup_requests < 0:
            raise ValueError("warmup_requests must be >= 0")
        if self.memory_bound_mib < 0 or self.idle_timeout_s <= 0:
            raise ValueError("memory_bound_mib must be >= 0 and idle_timeout_s > 0")

    @property
    def num_warmup_requests(self) -> int:
        if self.warmup_requests is None:
            return 2 * self.load.num_clients
        return self.warmup_requests


@dataclass(frozen=True)
class LoadTestReport(ServerReport):
    """The measured phase's tally (and the warm-up's), the engine's end state, memory, the
    pins created during the warm-up and during the measured phase (the estimator may stop
    pinning once it has seen the tool gaps the load stretches), and the checks; `passed` if
    every check did."""

    tally: LoadTally
    warmup: LoadTally
    pins_created: tuple[int, int] | None

    def figures(self) -> list[tuple[str, object]]:
        tally = self.tally
        outcomes = tally.outcomes
        return [
            ("requests sent (after a warm-up of)",
             f"{tally.num_sent} ({self.warmup.num_sent})"),
            ("requests by kind", ", ".join(f"{k} {v}" for k, v in sorted(tally.sent.items()))),
            ("peak concurrent requests", tally.peak_in_flight),
            ("completed", outcomes["ok"]),
            ("errors", tally.num_errors),
            ("rejected (429)", outcomes["rejected"]),
            ("disconnected mid-stream", outcomes["disconnected"]),
            ("gave up (client timeout)", outcomes["gave_up"]),
            ("agent jobs", ", ".join(f"{k} {v}" for k, v in sorted(tally.jobs.items()))),
            ("pins created (warm-up, measured)", self.pins_created),
            ("wall time (s)", f"{tally.wall_s:.1f}"),
            ("requests/s", f"{tally.num_sent / max(tally.wall_s, 1e-9):.1f}"),
            *self.server_rows(),
        ]

    def to_dict(self) -> dict[str, Any]:
        return {**self.tally.to_dict(), "warmup": self.warmup.to_dict(),
                "pins_created": None if self.pins_created is None else {
                    "warmup": self.pins_created[0], "measured": self.pins_created[1]},
                **self.server_dict()}


async def _probe(http: httpx.AsyncClient, model: str) -> tuple[int, ...] | None:
    """The seeded probe's generated ids; None if it was not answered correctly."""
    try:
        response = await http.post("/v1/completions", json={"model": model, **_PROBE})
        choice = response.json()["choices"][0]
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return None
    ids = tuple(choice.get("token_ids") or ())
    ok = response.status_code == 200 and len(ids) == _PROBE["max_tokens"]
    return ids if ok else None


async def _run_probe(base_url: str, model: str | None) -> tuple[int, ...] | None:
    async with httpx.AsyncClient(base_url=base_url, timeout=60.0) as http:
        try:
            model = model or await served_model(http)
        except (httpx.HTTPError, ValueError, KeyError, IndexError):
            return None
        return await _probe(http, model)


async def _sampled_run(generator: LoadGenerator, sampler: RssSampler) -> LoadTally:
    sampler.start()
    try:
        return await generator.run()
    finally:
        await sampler.stop()


def run_load_test(server: ServerProcess, settings: LoadTestSettings) -> LoadTestReport:
    """Runs the load test against a started `server` it does not own."""
    model = settings.load.model
    start_rss_mib = server.rss_mib()
    start_state = wait_idle(server, timeout_s=settings.idle_timeout_s)
    probe_before = asyncio.run(_run_probe(server.base_url, model))
    generator = LoadGenerator(server.base_url, settings.load)
    warmup = asyncio.run(generator.run(settings.num_warmup_requests))
    warm_state = wait_idle(server, timeout_s=settings.idle_timeout_s)
    sampler = RssSampler(server)
    baseline_rss_mib = sampler.sample()
    tally = asyncio.run(_sampled_run(generator, sampler))
    end_state = wait_idle(server, timeout_s=settings.idle_timeout_s)
    pins_created = _pins_created(start_state, warm_state, end_state)
    memory = sampler.memory(start_rss_mib=start_rss_mib, baseline_rss_mib=baseline_rss_mib,
                            bound_mib=settings.memory_bound_mib)
    probe_after = asyncio.run(_run_probe(server.base_url, model))
    checks = (*_traffic_checks(tally, warmup), *server_state_checks(end_state, memory),
              Check("server healthy after", server.is_healthy(), "GET /health"),
              _probe_check(probe_before, probe_after))
    return LoadTestReport(end_state=end_state, memory=memory, checks=checks, tally=tally,
                          warmup=warmup, pins_created=pins_created)


def _pins_created(*states: EngineEndState | None) -> tuple[int, int] | None:
    """Pins created between the start and the warm-up's end, and in the measured phase."""
    start, warm, end = states
    if start is None or warm is None or end is None:
        return None
    return warm.pins_created - start.pins_created, end.pins_created - warm.pins_created


def _traffic_checks(tally: LoadTally, warmup: LoadTally) -> list[Check]:
    errors = tally.errors + warmup.errors
    detail = "; ".join(f"{k}: {v}" for k, v in sorted(errors.items())) or "none"
    return [
        Check("no errors", not errors, detail),
        Check("requests completed", tally.outcomes["ok"] > 0,
              f"{tally.outcomes['ok']} of {tally.num_sent}"),
        Check("within the time limit", tally.cut_at_time_limit == 0,
              f"{tally.cut_at_time_limit} clients cut off"),
    ]


def _probe_check(before: tuple[int, ...] | None, after: tuple[int, ...] | None) -> Check:
    same = before is not None and before == after
    return Check("final request served correctly", same,
                 "seeded probe identical before and after the load" if same
                 else f"before {before}, after {after}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_flags(parser, LoadSettings, LoadTestSettings)
    add_server_arguments(parser, DEFAULT_SERVE_ARGS)
    parser.add_argument("--check-invariants", action="store_true",
                        help="add --debug-check-invariants to the server's flags")
    parser.add_argument("--json", default=None, help="write the figures and checks here")


def main(args: argparse.Namespace) -> int:
    try:
        load = settings_from_args(LoadSettings, args, long_max_tokens=max(
            args.max_tokens, LoadSettings.long_max_tokens))
        settings = settings_from_args(LoadTestSettings, args, load=load)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return run_against_server(args, lambda server: run_load_test(server, settings),
                              check_invariants=args.check_invariants,
                              context={"settings": asdict(settings)})
