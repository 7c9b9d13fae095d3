"""`continuum bench flood`: one tenant's flood of completions against a `continuum serve`
subprocess (loopback, two tenants), measured from the other tenant.

One attack (`--attack requests`): the victim streams completions one after another and times
each one's first token and the gaps between its tokens, first alone for `--baseline-s`, then
for `--attack-s` while the attacker submits `--flood-requests` completions of `--flood-tokens`
tokens each, `--wave` at a time every `--wave-interval-s` (paced, so that the server's
preparation queue, 64 a tenant, takes them in and they wait in the engine's queue), until all
are submitted or the attack phase ends. The attacker runs in a child process with an event
loop and HTTP client of its own, as a remote client would. Figures: the victim's latencies in
both phases and the attacker's statuses. Check: the victim's worst time to first token in the
attack is at most `--max-first-token-s`: a queue shared first come, first served makes it
wait for the whole flood ahead of it, and a batch and KV pool full of the attacker's requests
until one of them finishes. Its decoding shares the batch with the attacker's requests, so
its inter-token latency is reported, not checked.

Exit status 1 if a check failed or a server did not start, 2 for bad flags.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter
from dataclasses import dataclass

import httpx

from eval.attack_bench import (
    TENANT_ARGS,
    Victim,
    add_attack_arguments,
    attacker_completion,
    attacker_process,
    counts_text,
    ms_text,
    run_attacks,
    served_model,
)
from eval.server_checks import Check
from eval.server_process import ServerProcess

DEFAULT_SERVE_ARGS = ("--num-kv-blocks", "512", "--max-model-len", "1024",
                      "--no-job-inference", *TENANT_ARGS)
ATTACKS = ("requests",)


@dataclass(frozen=True)
class FloodSettings:
    """The flags of a run (see the module docstring)."""

    flood_requests: int = 1_000
    flood_tokens: int = 128
    wave: int = 40
    wave_interval_s: float = 0.3
    baseline_s: float = 8.0
    attack_s: float = 30.0
    victim_tokens: int = 16
    max_first_token_s: float = 2.0

    def __post_init__(self) -> None:
        if min(self.flood_requests, self.flood_tokens, self.wave, self.victim_tokens) < 1:
            raise ValueError("counts must be >= 1")
        if min(self.baseline_s, self.attack_s, self.max_first_token_s) <= 0 or (
                self.wave_interval_s < 0):
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


async def _attack(server: ServerProcess, attack: str, settings: FloodSettings
                  ) -> tuple[list[tuple[str, object]], list[Check]]:
    victim, stop = Victim(), asyncio.Event()
    loop = asyncio.get_running_loop()
    async with (attacker_process(attackers_ready) as attacker,
                httpx.AsyncClient(base_url=server.base_url, timeout=300.0) as http):
        model = await served_model(http)
        victim_task = asyncio.create_task(
            victim.run(http, model, settings.victim_tokens, stop))
        await asyncio.sleep(settings.baseline_s)
        victim.phase = "attack"
        flood_done = loop.run_in_executor(attacker, run_flood, server.base_url, model,
                                          settings)
        await asyncio.sleep(settings.attack_s)
        stop.set()
        await victim_task
        statuses = await flood_done
    # Ratios of a shared batch's latencies are figures here, not checks.
    victim_figures, _ = victim.figures_and_checks(attack, float("inf"), first_token=True)
    worst_s = max(victim.first_token_s["attack"], default=None)
    figures: list[tuple[str, object]] = [
        (f"{attack}: attacker's statuses", counts_text(statuses)), *victim_figures]
    return figures, [
        Check(f"{attack}: the server survived", server.is_healthy(), ""),
        Check(f"{attack}: victim's worst time to first token at most "
              f"{settings.max_first_token_s} s",
              worst_s is not None and worst_s <= settings.max_first_token_s,
              "no first token" if worst_s is None else f"{ms_text(worst_s)} ms"),
    ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_attack_arguments(parser, ATTACKS, FloodSettings(), (
        ("flood_requests", "completions the attacker submits"),
        ("flood_tokens", "tokens of each of the attacker's completions"),
        ("wave", "completions the attacker submits at once"),
        ("wave_interval_s", "seconds between the attacker's waves"),
        ("baseline_s", "seconds the victim runs alone first"),
        ("attack_s", "seconds of attack"),
        ("victim_tokens", "tokens of each victim completion"),
        ("max_first_token_s", "most seconds to the victim's first token in the attack"),
    ), DEFAULT_SERVE_ARGS)


def main(args: argparse.Namespace) -> int:
    return run_attacks(args, ATTACKS, FloodSettings, _attack)
