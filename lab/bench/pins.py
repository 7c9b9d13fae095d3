"""`python -m lab pins`: one tenant's agent jobs that keep the KV pool pinned, against a
`continuum serve` subprocess (loopback, two tenants), measured from the other tenant.

The attacker runs `--jobs` agent jobs at once, turn after turn, each a prompt of about
`--job-tokens` tokens (the previous turn's prompt and a tool result appended, the oldest
text dropped) answered with `--turn-tokens` tokens, then `--tool-s` of tool time; the victim
sends plain completions of a fresh `--victim-prompt-tokens`-token prompt one after another
and times each. First the attacker's turns go without a job (`--baseline-s`: the same load,
nothing pinned), then as turns of its jobs that each end in a tool call and never a last
step (`--attack-s`), so that every finished turn is pinned for the estimator's TTL (the
server runs `estimator=fixed-2s`). The attacker runs in a child process with an event loop
and HTTP client of its own, as a remote client would. Figures: the victim's latency by
phase, and the pool's pinned blocks during the attack (sampled from `/metrics` every
`--sample-s`). Checks: the victim's median and p90 latency in the attack within
`--max-ratio` of the baseline's; the pinned blocks never above the attacker's share of the
pool (half of it: the victim and the attacker compete).

Another (`--attack breakpoint`), `--runs` times on one server: the victim sends a Messages
API turn whose system prompt of about `--breakpoint-tokens` tokens carries a `cache_control`
breakpoint of an hour (a client pin of its own tenant); then the attacker grows
`--grow-requests` completions of `--grow-tokens` tokens each at once, past its share of the
pool (half of it), until they end; then the victim's next turn continues the first. Check:
in every run the victim's pin is still there (`GET /v1/jobs/...`) and its next turn reads
the whole breakpoint prefix from the cache (`cache_read_input_tokens`).

Exit status 1 if a check failed or a server did not start, 2 for bad flags.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import httpx

from eval.replay_metrics import percentile
from lab.attack_bench import (
    ATTACKER_KEY,
    TENANT_ARGS,
    VICTIM_KEY,
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

NUM_KV_BLOCKS = 1024
DEFAULT_SERVE_ARGS = ("--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-model-len", "4096",
                      "--no-job-inference", "--policy-option", "estimator=fixed-2s",
                      *TENANT_ARGS)
ATTACKS = ("pins", "breakpoint")
BLOCK_SIZE = 16
PHASES = ("baseline", "attack")
# The tiny model's tokenizer reads bytes: a character of these texts is about a token.
_WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel")


@dataclass(frozen=True)
class PinsSettings:
    """The flags of a run (see the module docstring)."""

    jobs: int = bench_setting(4, "agent jobs the attacker runs at once")
    job_tokens: int = bench_setting(4_000, "tokens of each attacker prompt")
    turn_tokens: int = bench_setting(4, "tokens of each attacker turn's answer")
    tool_s: float = bench_setting(1.5, "seconds of tool time between an attacker job's turns")
    victim_prompt_tokens: int = bench_setting(2_500, "tokens of each victim prompt")
    baseline_s: float = bench_setting(20.0, "seconds of the attacker's load without pins")
    attack_s: float = bench_setting(40.0, "seconds of the attacker's pinned jobs")
    sample_s: float = bench_setting(0.2, "seconds between samples of the pinned blocks")
    max_ratio: float = bench_setting(1.5,
        "most the victim's median and p90 latency may grow in the attack")
    runs: int = bench_setting(10, "breakpoint: runs of victim pin, attacker growth, victim turn")
    breakpoint_tokens: int = bench_setting(1_648,
        "breakpoint: tokens of the victim's system prompt")
    grow_requests: int = bench_setting(4, "breakpoint: the attacker's completions grown at once")
    grow_tokens: int = bench_setting(4_000, "breakpoint: tokens each of them generates")

    def __post_init__(self) -> None:
        if min(self.jobs, self.job_tokens, self.turn_tokens, self.victim_prompt_tokens,
               self.runs, self.breakpoint_tokens, self.grow_requests, self.grow_tokens) < 1:
            raise ValueError("counts must be >= 1")
        if min(self.baseline_s, self.attack_s, self.sample_s, self.max_ratio) <= 0 or (
                self.tool_s < 0):
            raise ValueError("durations and the ratio must be positive (--tool-s at least 0)")


def text_of(num_tokens: int, seed: int) -> str:
    """About `num_tokens` tokens of text that shares no prefix with another seed's."""
    words = itertools.cycle(_WORDS)
    text = f"{seed:08d} "
    while len(text) < num_tokens:
        text += f"{next(words)}{len(text) % 97} "
    return text[:num_tokens]


def attackers_ready() -> None:
    """Run once in the attacker's child process before the baseline, so that it has imported
    this module when the attack starts."""


def run_jobs(base_url: str, model: str, settings: PinsSettings, phase: str,
             until_s: float) -> Counter[int | str]:
    """The attacker's jobs until `until_s` (on this machine's monotonic clock): without a job
    in the baseline, as turns of pinned jobs in the attack; the count of each status. Runs in
    the attacker's child process."""

    async def job(http: httpx.AsyncClient, index: int, statuses: Counter[int | str]) -> None:
        context = text_of(settings.job_tokens, seed=1000 * index + (phase == "attack"))
        for turn in itertools.count():
            if time.monotonic() >= until_s:
                return
            body: dict[str, Any] = {"model": model, "prompt": context,
                                    "max_tokens": settings.turn_tokens, "ignore_eos": True}
            if phase == "attack":
                body.update(job_id=f"attacker-{index}", tool_name="bash")
            try:
                response = await http.post("/v1/completions", json=body,
                                           headers=auth(ATTACKER_KEY))
                statuses[response.status_code] += 1
                output = response.json()["choices"][0]["text"] if response.is_success else ""
            except httpx.HTTPError as error:
                statuses[type(error).__name__] += 1
                output = ""
            await asyncio.sleep(settings.tool_s)
            # ASCII only: the tiny model's bytes that are not UTF-8 come back as U+FFFD, which
            # re-encodes as three tokens and would grow the prompt past its token count.
            output = output.encode("ascii", "ignore").decode()
            context = (context + output + f" result {turn}. ")[-settings.job_tokens:]

    async def jobs() -> Counter[int | str]:
        statuses: Counter[int | str] = Counter()
        async with httpx.AsyncClient(base_url=base_url, timeout=600.0) as http:
            await asyncio.gather(*(job(http, index, statuses)
                                   for index in range(settings.jobs)))
        return statuses

    return asyncio.run(jobs())


async def _victim(http: httpx.AsyncClient, model: str, settings: PinsSettings,
                  phase: list[str], latencies_s: dict[str, list[float]],
                  stop: asyncio.Event) -> None:
    """Plain completions one after another, each of a fresh prompt; latencies by phase."""
    for index in itertools.count():
        if stop.is_set():
            return
        current, sent_s = phase[0], time.monotonic()
        response = await http.post("/v1/completions", headers=auth(VICTIM_KEY), json={
            "model": model, "prompt": text_of(settings.victim_prompt_tokens, seed=-1 - index),
            "max_tokens": 4, "ignore_eos": True})
        if response.is_success:
            latencies_s[current].append(time.monotonic() - sent_s)


async def _pinned_blocks(http: httpx.AsyncClient, settings: PinsSettings,
                         stop: asyncio.Event) -> list[float]:
    samples: list[float] = []
    while not stop.is_set():
        response = await http.get("/metrics", headers=auth(VICTIM_KEY))
        samples.append(parse_prometheus(response.text).get("continuum:pinned_blocks", 0.0))
        await asyncio.sleep(settings.sample_s)
    return samples


async def _attack(server: ServerProcess, attack: str, settings: PinsSettings
                  ) -> tuple[list[tuple[str, object]], list[Check]]:
    if attack == "breakpoint":
        return await _breakpoint_attack(server, settings)
    loop = asyncio.get_running_loop()
    phase = ["baseline"]
    latencies_s: dict[str, list[float]] = {name: [] for name in PHASES}
    stop, sampling = asyncio.Event(), asyncio.Event()
    async with (attacker_process(attackers_ready) as attacker,
                httpx.AsyncClient(base_url=server.base_url, timeout=600.0) as http):
        model = await served_model(http)
        victim = asyncio.create_task(_victim(http, model, settings, phase, latencies_s, stop))
        statuses = await loop.run_in_executor(
            attacker, run_jobs, server.base_url, model, settings, "baseline",
            time.monotonic() + settings.baseline_s)
        phase[0] = "attack"
        sampler = asyncio.create_task(_pinned_blocks(http, settings, sampling))
        statuses += await loop.run_in_executor(
            attacker, run_jobs, server.base_url, model, settings, "attack",
            time.monotonic() + settings.attack_s)
        sampling.set()
        stop.set()
        await victim
        samples = await sampler
    figures: list[tuple[str, object]] = [
        (f"{attack}: attacker's statuses", counts_text(statuses)),
        (f"{attack}: victim requests baseline / attack",
         " / ".join(str(len(latencies_s[name])) for name in PHASES)),
        (f"{attack}: pinned blocks in the attack, median / most (pool {NUM_KV_BLOCKS})",
         f"{percentile(samples, 50.0) or 0:.0f} / {max(samples, default=0):.0f}")]
    checks = [Check(f"{attack}: the server survived", server.is_healthy(), ""),
              Check(f"{attack}: pins never held more than the attacker's share",
                    max(samples, default=0) <= NUM_KV_BLOCKS / 2,
                    f"most {max(samples, default=0):.0f} of {NUM_KV_BLOCKS / 2:.0f}")]
    for name, q in (("median", 50.0), ("p90", 90.0)):
        before = percentile(latencies_s["baseline"], q)
        during = percentile(latencies_s["attack"], q)
        figures.append((f"{attack}: victim latency {name}, ms (baseline / attack)",
                        f"{ms_text(before)} / {ms_text(during)}"))
        ratio = None if not before or during is None else during / before
        checks.append(Check(f"{attack}: victim latency {name} within {settings.max_ratio}x",
                            ratio is not None and ratio <= settings.max_ratio,
                            "no requests" if ratio is None else f"{ratio:.2f}x"))
    return figures, checks


async def _breakpoint_attack(server: ServerProcess, settings: PinsSettings
                             ) -> tuple[list[tuple[str, object]], list[Check]]:
    """The breakpoint attack (see the module docstring)."""
    kept, read_tokens, grown = 0, [], Counter[int | str]()
    async with httpx.AsyncClient(base_url=server.base_url, timeout=600.0) as http:
        model = await served_model(http)
        for run in range(settings.runs):
            job_id, system = f"victim-{run}", [{
                "type": "text", "text": text_of(settings.breakpoint_tokens, seed=10_000 + run),
                "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
            first = [{"role": "user", "content": "Hello."}]
            await _victim_turn(http, model, job_id, system, first)
            grown += Counter(await asyncio.gather(*(
                attacker_completion(http, {
                    "model": model, "prompt": text_of(16, seed=run * 100 + index),
                    "max_tokens": settings.grow_tokens, "ignore_eos": True})
                for index in range(settings.grow_requests))))
            pin = (await http.get(f"/v1/jobs/{job_id}", headers=auth(VICTIM_KEY))).json()
            kept += pin.get("pin") is not None
            usage = await _victim_turn(http, model, job_id, system, [
                *first, {"role": "assistant", "content": "Hi."},
                {"role": "user", "content": "Once more?"}])
            read_tokens.append(int(usage.get("cache_read_input_tokens", 0)))
    prefix = settings.breakpoint_tokens // BLOCK_SIZE * BLOCK_SIZE
    return [("breakpoint: attacker's growing completions", counts_text(grown)),
            ("breakpoint: runs whose pin survived", f"{kept} of {settings.runs}"),
            ("breakpoint: cached tokens the next turn read, least / most",
             f"{min(read_tokens)} / {max(read_tokens)}")], [
        Check("breakpoint: the server survived", server.is_healthy(), ""),
        Check("breakpoint: the victim's pin survived every run", kept == settings.runs,
              f"{kept} of {settings.runs}"),
        Check(f"breakpoint: every next turn read at least {prefix} cached tokens",
              min(read_tokens) >= prefix, f"least {min(read_tokens)}")]


async def _victim_turn(http: httpx.AsyncClient, model: str, job_id: str, system: list,
                       messages: list) -> dict[str, Any]:
    """One Messages API turn of the victim's job; its usage."""
    response = await http.post("/v1/messages", headers=auth(VICTIM_KEY), json={
        "model": model, "max_tokens": 4, "system": system, "messages": messages,
        "job_id": job_id})
    response.raise_for_status()
    return dict(response.json()["usage"])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_attack_arguments(parser, ATTACKS, PinsSettings, DEFAULT_SERVE_ARGS)


def main(args: argparse.Namespace) -> int:
    return run_attacks(args, ATTACKS, PinsSettings, _attack)
