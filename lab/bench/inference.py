"""`python -m lab inference`: one tenant's requests of one prompt, filed by job inference,
against a `continuum serve` subprocess (loopback, two tenants, job inference on), measured
from the other tenant.

The attacker first sends `--turns` requests of one prompt (`--concurrency` at a time, one
token each), each of which the engine files as a finished turn of an inferred job under that
prompt. Then the victim streams completions one after another and times each one's first
token and the gaps between its tokens, for `--baseline-s` while the attacker sends, at the
same concurrency, requests that continue another prompt as long (the same load, its prefix
cached alike, but one turn under it at a time), then for `--attack-s` while it sends
requests that continue the filed prompt, so that the engine core looks the filed turns up
for every one of them. The attacker runs in a child
process with an event loop and HTTP client of its own, as a remote client would.

Beside it, in this process, one lookup is timed directly: a `JobInference` table holding
`--turns` turns of one prompt, then a request that continues it (the median of 20).

Figures: the victim's latencies in both phases, the attacker's statuses, the lookup's time.
Checks: the victim's first-token and inter-token median and p99 within `--max-ratio` of the
baseline's; the lookup at most `--max-lookup-ms`.

Exit status 1 if a check failed or a server did not start, 2 for bad flags.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections import Counter
from dataclasses import dataclass

import httpx

from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler.job_inference import JobInference
from lab.attack_bench import (
    TENANT_ARGS,
    Victim,
    add_attack_arguments,
    attacker_completion,
    attacker_process,
    counts_text,
    run_attacks,
    served_model,
)
from lab.flags import bench_setting
from lab.server_checks import Check
from lab.server_process import ServerProcess

DEFAULT_SERVE_ARGS = ("--num-kv-blocks", "512", "--max-model-len", "1024", *TENANT_ARGS)
ATTACKS = ("inference",)
# The filed prompt: the tiny model reads a byte a token, so this is about 200 tokens; the
# baseline's requests continue another prompt as long, which the engine filed once.
FILED_PROMPT = "one prompt, many requests: " * 8
OTHER_PROMPT = "another prompt, one filed: " * 8
LOOKUP_REPEATS = 20
_BLOCK_SIZE = 16


@dataclass(frozen=True)
class InferenceSettings:
    """The flags of a run (see the module docstring)."""

    turns: int = bench_setting(4_096, "requests of one prompt the attacker files first")
    concurrency: int = bench_setting(16, "the attacker's requests in flight")
    baseline_s: float = bench_setting(15.0,
        "seconds of the attacker's fresh prompts beside the victim")
    attack_s: float = bench_setting(15.0,
        "seconds of the attacker's continuations of the filed prompt")
    victim_tokens: int = bench_setting(16, "tokens of each victim completion")
    max_ratio: float = bench_setting(1.5, "most the victim's latencies may grow in the attack")
    max_lookup_ms: float = bench_setting(1.0, "most milliseconds one lookup may take")

    def __post_init__(self) -> None:
        if min(self.turns, self.concurrency, self.victim_tokens) < 1:
            raise ValueError("counts must be >= 1")
        if min(self.baseline_s, self.attack_s, self.max_ratio, self.max_lookup_ms) <= 0:
            raise ValueError("durations and ratios must be positive")


def attackers_ready() -> None:
    """Run once in the attacker's child process before the baseline, so that it has imported
    this module when the attack starts."""


def run_requests(base_url: str, model: str, settings: InferenceSettings, kind: str,
                 count: int | None, until_s: float | None) -> Counter[int | str]:
    """`settings.concurrency` clients sending one-token requests until `count` were sent or
    `until_s` (this machine's monotonic clock) passed: of the filed prompt (`kind` "file"),
    continuing it ("continue") or continuing another prompt as long ("other"), whose
    prefix is cached alike but whose turns are filed one at a time; the count of each
    status. Runs in the attacker's child process."""

    def prompt(index: int) -> str:
        if kind == "file":
            return FILED_PROMPT
        return f"{FILED_PROMPT if kind == 'continue' else OTHER_PROMPT} and then {index}"

    async def client(http: httpx.AsyncClient, serial: list[int],
                     statuses: Counter[int | str]) -> None:
        while ((count is None or serial[0] < count)
               and (until_s is None or time.monotonic() < until_s)):
            serial[0] += 1
            statuses[await attacker_completion(http, {
                "model": model, "prompt": prompt(serial[0]), "max_tokens": 1,
                "ignore_eos": True})] += 1

    async def clients() -> Counter[int | str]:
        statuses: Counter[int | str] = Counter()
        serial = [0]
        async with httpx.AsyncClient(base_url=base_url, timeout=300.0) as http:
            await asyncio.gather(*(client(http, serial, statuses)
                                   for _ in range(settings.concurrency)))
        return statuses

    return asyncio.run(clients())


def lookup_ms(num_turns: int) -> float:
    """The median time of one lookup (ms) in a table holding `num_turns` turns of one prompt,
    by a request that continues it."""
    inference = JobInference(_BLOCK_SIZE, max_turns=max(num_turns, 1), max_age_s=3600.0,
                             decode=lambda ids: bytes(i % 256 for i in ids).decode(
                                 "utf-8", errors="replace"))
    prompt = list(FILED_PROMPT.encode())
    for index in range(num_turns):
        request = Request(f"filed-{index}", prompt, SamplingParams(max_tokens=1),
                          arrival_time_s=0.0)
        request.job = inference.infer(request, 0.0).job
        request.append_output_token_id(ord("x"))
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        inference.turn_finished(request, float(index) / num_turns)
    times_s = []
    for repeat in range(LOOKUP_REPEATS):
        request = Request(f"next-{repeat}", [*prompt, *b"x and then"],
                          SamplingParams(max_tokens=1), arrival_time_s=0.0)
        started_s = time.perf_counter()
        inference.infer(request, 1.0)  # the outputs differ: a tie, nothing is taken
        times_s.append(time.perf_counter() - started_s)
    return statistics.median(times_s) * 1e3


async def _attack(server: ServerProcess, attack: str, settings: InferenceSettings
                  ) -> tuple[list[tuple[str, object]], list[Check]]:
    victim, stop = Victim(), asyncio.Event()
    loop = asyncio.get_running_loop()
    async with (attacker_process(attackers_ready) as attacker,
                httpx.AsyncClient(base_url=server.base_url, timeout=300.0) as http):
        model = await served_model(http)
        filed = await loop.run_in_executor(attacker, run_requests, server.base_url, model,
                                           settings, "file", settings.turns, None)
        victim_task = asyncio.create_task(victim.run(http, model, settings.victim_tokens, stop))
        baseline = await loop.run_in_executor(
            attacker, run_requests, server.base_url, model, settings, "other", None,
            time.monotonic() + settings.baseline_s)
        victim.phase = "attack"
        attacked = await loop.run_in_executor(
            attacker, run_requests, server.base_url, model, settings, "continue", None,
            time.monotonic() + settings.attack_s)
        stop.set()
        await victim_task
    lookup = lookup_ms(settings.turns)
    victim_figures, checks = victim.figures_and_checks(attack, settings.max_ratio,
                                                       first_token=True)
    figures: list[tuple[str, object]] = [
        (f"{attack}: attacker's statuses, filing / baseline / attack",
         " / ".join(counts_text(statuses) for statuses in (filed, baseline, attacked))),
        (f"{attack}: one lookup among {settings.turns} turns of one prompt, ms",
         f"{lookup:.3f}"),
        *victim_figures]
    return figures, [
        Check(f"{attack}: the server survived", server.is_healthy(), ""),
        Check(f"{attack}: one lookup at most {settings.max_lookup_ms} ms",
              lookup <= settings.max_lookup_ms, f"{lookup:.3f} ms"),
        *checks]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_attack_arguments(parser, ATTACKS, InferenceSettings, DEFAULT_SERVE_ARGS)


def main(args: argparse.Namespace) -> int:
    return run_attacks(args, ATTACKS, InferenceSettings, _attack)
