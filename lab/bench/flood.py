"""`python -m lab flood`: one tenant's flood of completions against a `continuum serve`
subprocess (loopback, two tenants), measured from the other tenant.

One attack (`--attack requests`): the victim streams completions one after another and times
each one's first token and the gaps between its tokens, first alone for `--baseline-s`, then for
`--attack-s` while the attacker submits `--flood-requests` completions of `--flood-tokens`
tokens each, `--wave` at a time every `--wave-interval-s` (paced, so that the server's
preparation queue, 64 a tenant, takes them in and they wait in the engine's queue), until all
are submitted or the attack phase ends. The attacker runs in a child process with an event loop
and HTTP client of its own, as a remote client would. Figures: the victim's latencies in both
phases, the attacker's statuses, and the engine's waiting requests at their peak in each phase
(sampled from `/metrics` every `QUEUE_SAMPLE_S`). Check: the victim's worst time to first token
in the attack is at most `--max-first-token-s`: a queue shared first come, first served makes it
wait for the whole flood ahead of it, and a batch and KV pool full of the attacker's requests
until one of them finishes. Its decoding shares the batch with the attacker's requests, so its
inter-token latency is reported, not checked.

Another (`--attack fanout`): the attacker's clients each send one completion call after
another, each of `--fanout-prompts` prompts with `n` `--fanout-n` (64 x 16 = 1,024 engine
requests a call by default) of `--fanout-tokens` tokens: one client through the baseline
(the attacker's load, its share of the batch full, without the fan-out's queue), then
`--fanout-callers` at once for `--attack-s` (twenty calls would put 20,480 of one tenant's
requests in the engine's queue). The victim times each whole completion too. Figures as
above, the attacker's statuses by phase. Checks: the victim's latencies (inter-token, first
token, whole completion), median and p99, within `--max-latency-ratio` of the baseline's.

Exit status 1 if a check failed or a server did not start, 2 for bad flags.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections import Counter
from dataclasses import dataclass

import httpx

from lab.attack_bench import (
    TENANT_ARGS,
    VICTIM_KEY,
    Victim,
    add_attack_arguments,
    attacker_completion,
    attacker_process,
    auth,
    counts_text,
    ms_text,
    run_attacks,
    served_model,
)
from lab.flags import bench_setting
from lab.server_checks import Check
from lab.server_process import ServerProcess, parse_prometheus

DEFAULT_SERVE_ARGS = ("--num-kv-blocks", "512", "--max-model-len", "1024",
                      "--no-job-inference", *TENANT_ARGS)
ATTACKS = ("requests", "fanout")
QUEUE_SAMPLE_S = 0.5


@dataclass(frozen=True)
class FloodSettings:
    """The flags of a run (see the module docstring)."""

    flood_requests: int = bench_setting(1_000, "completions the attacker submits")
    flood_tokens: int = bench_setting(128, "tokens of each of the attacker's completions")
    wave: int = bench_setting(40, "completions the attacker submits at once")
    wave_interval_s: float = bench_setting(0.3, "seconds between the attacker's waves")
    baseline_s: float = bench_setting(8.0,
        "seconds of baseline first: the victim alone (fanout: beside the attacker's one "
        "client)")
    attack_s: float = bench_setting(30.0, "seconds of attack")
    victim_tokens: int = bench_setting(16, "tokens of each victim completion")
    max_first_token_s: float = bench_setting(2.0,
        "requests: most seconds to the victim's first token in the attack")
    fanout_callers: int = bench_setting(20, "fanout: clients each sending one call after another")
    fanout_prompts: int = bench_setting(64, "fanout: prompts of each call")
    fanout_n: int = bench_setting(16, "fanout: completions of each prompt")
    fanout_tokens: int = bench_setting(16, "fanout: tokens of each completion")
    max_latency_ratio: float = bench_setting(1.5,
        "fanout: most victim latency under attack over its baseline")

    def __post_init__(self) -> None:
        if min(self.flood_requests, self.flood_tokens, self.wave, self.victim_tokens,
               self.fanout_callers, self.fanout_prompts, self.fanout_n,
               self.fanout_tokens) < 1:
            raise ValueError("counts must be >= 1")
        if min(self.baseline_s, self.attack_s, self.max_first_token_s,
               self.max_latency_ratio) <= 0 or self.wave_interval_s < 0:
            raise ValueError("durations must be positive (--wave-interval-s at least 0)")


def attackers_ready() -> None:
    """Run once in the attacker's child process before the baseline, so that it has imported
    this module when the attack starts."""


def run_flood(base_url: str, model: str, settings: FloodSettings) -> Counter[int | str]:
    """Submits the flood (see the module docstring) and waits for its answers, at most
    `settings.attack_s` from the start; the count of each status or error ("unanswered"
    for those still running then). Runs in the attacker's child process."""

    async def flood() -> Counter[int | str]:
        until_s = time.monotonic() + settings.attack_s
        body = {"model": model, "prompt": "attack " * 50, "max_tokens": settings.flood_tokens,
                "ignore_eos": True}
        async with httpx.AsyncClient(base_url=base_url, timeout=300.0,
                                     limits=httpx.Limits(max_connections=None)) as http:
            tasks: list[asyncio.Task[int | str]] = []
            while len(tasks) < settings.flood_requests and time.monotonic() < until_s:
                tasks += [asyncio.create_task(attacker_completion(http, body))
                          for _ in range(min(settings.wave,
                                             settings.flood_requests - len(tasks)))]
                await asyncio.sleep(settings.wave_interval_s)
            done, pending = await asyncio.wait(tasks,
                                               timeout=max(0.0, until_s - time.monotonic()))
            for task in pending:
                task.cancel()
        statuses: Counter[int | str] = Counter(task.result() for task in done)
        statuses["unanswered"] += len(pending)
        return statuses

    return asyncio.run(flood())


def run_fanout(base_url: str, model: str, settings: FloodSettings
               ) -> dict[str, Counter[int | str]]:
    """The fan-out (see the module docstring): one client from now, `settings.fanout_callers`
    from `settings.baseline_s` on, until `settings.attack_s` later; the count of each
    status or error of the calls sent in each phase ("unanswered" for the calls still
    running at the end). Runs in the attacker's child process."""

    async def fan_out() -> dict[str, Counter[int | str]]:
        attack_from_s = time.monotonic() + settings.baseline_s
        until_s = attack_from_s + settings.attack_s
        statuses: dict[str, Counter[int | str]] = {"baseline": Counter(), "attack": Counter()}
        body = {"model": model, "prompt": [f"fan out {index} " * 8
                                           for index in range(settings.fanout_prompts)],
                "n": settings.fanout_n, "max_tokens": settings.fanout_tokens,
                "ignore_eos": True}

        async def caller(http: httpx.AsyncClient, from_s: float) -> None:
            await asyncio.sleep(max(0.0, from_s - time.monotonic()))
            while (sent_s := time.monotonic()) < until_s:
                status = await attacker_completion(http, body)
                statuses["baseline" if sent_s < attack_from_s else "attack"][status] += 1

        async with httpx.AsyncClient(base_url=base_url, timeout=300.0,
                                     limits=httpx.Limits(max_connections=None)) as http:
            tasks = [asyncio.create_task(caller(http, time.monotonic())),
                     *(asyncio.create_task(caller(http, attack_from_s))
                       for _ in range(settings.fanout_callers - 1))]
            _, pending = await asyncio.wait(tasks, timeout=until_s - time.monotonic())
            for task in pending:
                task.cancel()
        statuses["attack"]["unanswered"] += len(pending)
        return statuses

    return asyncio.run(fan_out())


async def _attack(server: ServerProcess, attack: str, settings: FloodSettings
                  ) -> tuple[list[tuple[str, object]], list[Check]]:
    victim, stop = Victim(), asyncio.Event()
    loop = asyncio.get_running_loop()
    async with (attacker_process(attackers_ready) as attacker,
                httpx.AsyncClient(base_url=server.base_url, timeout=300.0) as http):
        model = await served_model(http)
        victim_task = asyncio.create_task(
            victim.run(http, model, settings.victim_tokens, stop))
        peaks = {"baseline": 0.0, "attack": 0.0}
        sampler = asyncio.create_task(_sample_waiting(http, victim, peaks, stop))
        if attack == "fanout":  # from the baseline on: it has the attacker's load
            attack_done = loop.run_in_executor(attacker, run_fanout, server.base_url, model,
                                               settings)
        await asyncio.sleep(settings.baseline_s)
        victim.phase = "attack"
        if attack == "requests":
            attack_done = loop.run_in_executor(attacker, run_flood, server.base_url, model,
                                               settings)
        await asyncio.sleep(settings.attack_s)
        stop.set()
        await victim_task
        await sampler
        statuses = await attack_done
    survived = Check(f"{attack}: the server survived", server.is_healthy(), "")
    queue_figure = (f"{attack}: engine requests waiting, peak (baseline / attack)",
                    f"{peaks['baseline']:.0f} / {peaks['attack']:.0f}")
    if attack == "fanout":
        victim_figures, checks = victim.figures_and_checks(
            attack, settings.max_latency_ratio, first_token=True, whole_request=True)
        return [*((f"{attack}: attacker's statuses, {phase}", counts_text(by_phase))
                  for phase, by_phase in statuses.items()),
                queue_figure, *victim_figures], [survived, *checks]
    # Ratios of a shared batch's latencies are figures here, not checks.
    victim_figures, _ = victim.figures_and_checks(attack, float("inf"), first_token=True)
    worst_s = max(victim.first_token_s["attack"], default=None)
    figures: list[tuple[str, object]] = [
        (f"{attack}: attacker's statuses", counts_text(statuses)), queue_figure,
        *victim_figures]
    return figures, [
        survived,
        Check(f"{attack}: victim's worst time to first token at most "
              f"{settings.max_first_token_s} s",
              worst_s is not None and worst_s <= settings.max_first_token_s,
              "no first token" if worst_s is None else f"{ms_text(worst_s)} ms"),
    ]


async def _sample_waiting(http: httpx.AsyncClient, victim: Victim, peaks: dict[str, float],
                          stop: asyncio.Event) -> None:
    """Keeps the peak of the engine's waiting requests (`/metrics`) in each of the victim's
    phases until `stop`."""
    while not stop.is_set():
        phase = victim.phase
        try:
            response = await http.get("/metrics", headers=auth(VICTIM_KEY))
            waiting = parse_prometheus(response.text).get("continuum:num_requests_waiting", 0.0)
            peaks[phase] = max(peaks[phase], waiting)
        except httpx.HTTPError:
            pass
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), QUEUE_SAMPLE_S)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_attack_arguments(parser, ATTACKS, FloodSettings, DEFAULT_SERVE_ARGS)


def main(args: argparse.Namespace) -> int:
    return run_attacks(args, ATTACKS, FloodSettings, _attack)
