"""`python -m lab grammars`: one tenant's hostile grammars against a `continuum serve`
subprocess (loopback, two tenants), measured from the other tenant.

Three attacks, each with its own server (`--attack memory|stall|rejected|all`):
- **memory**: the attacker sends `--distinct` grammars one after another, each a different
  JSON `enum` of `--enum-values` strings (about 330 KB of schema whose compiled lexer takes
  about 6.5 MB, with fast masks, so that a grammar cache would keep it), asking one token
  each. Figures: the server's resident memory (frontend and engine core)
  before, at its peak and after, and the answers' statuses. Check: the growth stays within
  `--memory-bound-mib`.
- **stall**: the victim streams completions one after another and times the gaps between
  its tokens, first alone for `--baseline-s`, then while the attacker sends `--attackers`
  such grammars at once (asking `--attack-tokens` tokens each; masks of these grammars take
  tens of ms a token), until every attacker is answered or `--attack-s` passed. Figures:
  the victim's inter-token latency and time to first token (median, p99, max) in both
  phases, and the attackers' statuses. Check: the victim's medians and p99s stay within
  `--max-latency-ratio` of the baseline's. `--control` sends the same completions without
  a grammar: what as many plain requests cost the victim. `--victim-grammar` gives each of
  the victim's completions a grammar of its own (a distinct regex, compiled for it): its
  first token then waits for its compile, which the engine core takes in the tenants'
  turns, so the attackers' backlog of compiles counts once at most.
- **rejected**: the attacker sends `--rejected-grammars` chat completions one after another,
  each with a `json_schema` response format whose string pattern is `^(a{1000}){N}$` (N from
  `--rejected-repeat-base` by `--rejected-repeat-step`), a grammar whose lexer would take
  hundreds of MiB and which the engine core refuses with a 400; the baseline, first, is as
  many ordinary schemas (a short pattern each, compiled and answered). Figures: the engine
  core's resident memory at the start, after the baseline, at its peak and at the end of the
  attack, and `--settle-s` later; the statuses. Checks: every hostile grammar is refused,
  the core's memory at the attack's end is at most `--max-rejected-growth-mib` over its start
  (before the baseline), and `--settle-s` later at most `--max-settled-ratio` times its start.

`--quick` shrinks every attack to a few seconds (a test's run).

Exit status 1 if a check failed or a server did not start, 2 for bad flags.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import httpx

from lab.attack_bench import (
    ATTACKER_KEY,
    TENANT_ARGS,
    Victim,
    add_attack_arguments,
    attacker_completion,
    auth,
    counts_text,
    run_attacks,
    served_model,
)
from lab.flags import bench_setting
from lab.server_checks import Check, RssSampler
from lab.server_process import (
    ServerProcess,
    read_rss_mib,
)

DEFAULT_SERVE_ARGS = ("--num-kv-blocks", "512", "--max-model-len", "1024",
                      "--no-job-inference", *TENANT_ARGS)
ATTACKS = ("memory", "stall", "rejected")


@dataclass(frozen=True)
class GrammarAttackSettings:
    """The flags of a run (see the module docstring)."""

    distinct: int = bench_setting(96, "memory: distinct grammars sent")
    enum_values: int = bench_setting(10_000, "memory: strings in each grammar's enum")
    memory_bound_mib: float = bench_setting(1024.0, "memory: most growth of the server's RSS, MiB")
    attackers: int = bench_setting(30, "stall: grammars sent at once")
    stall_repeat_base: int = bench_setting(120, "stall: K of the first attacker's grammar")
    attack_tokens: int = bench_setting(16, "stall: tokens each attacker asks for")
    baseline_s: float = bench_setting(8.0, "stall: seconds the victim runs alone first")
    attack_s: float = bench_setting(60.0, "stall: most seconds to wait for the attackers")
    victim_tokens: int = bench_setting(32, "stall: tokens of each victim completion")
    max_latency_ratio: float = bench_setting(1.5,
        "stall: most victim latency under attack over its baseline")
    control: bool = bench_setting(False,
        "stall: the attackers send the same completions without a grammar (what as many plain "
        "requests cost the victim)")
    victim_grammar: bool = bench_setting(False,
        "stall: each victim completion has a grammar of its own, compiled for it (its first "
        "token waits for that compile)")
    rejected_grammars: int = bench_setting(30,
        "rejected: hostile grammars sent (and ordinary ones before)")
    rejected_repeat_base: int = bench_setting(500,
        "rejected: N of the first hostile pattern ^(a{1000}){N}$")
    rejected_repeat_step: int = bench_setting(50,
        "rejected: N's step from one hostile pattern to the next")
    settle_s: float = bench_setting(60.0,
        "rejected: seconds after the attack when the core's memory is read again")
    max_rejected_growth_mib: float = bench_setting(512.0,
        "rejected: most growth of the core's RSS over the attack, MiB")
    max_settled_ratio: float = bench_setting(1.1,
        "rejected: most core RSS --settle-s after the attack over its start")

    def __post_init__(self) -> None:
        if min(self.distinct, self.enum_values, self.attackers, self.stall_repeat_base,
               self.attack_tokens, self.victim_tokens, self.rejected_grammars,
               self.rejected_repeat_base, self.rejected_repeat_step) < 1:
            raise ValueError("counts must be >= 1")
        if min(self.baseline_s, self.attack_s, self.memory_bound_mib,
               self.max_latency_ratio, self.max_rejected_growth_mib) <= 0:
            raise ValueError("durations, bounds and ratios must be positive")
        if self.settle_s < 0 or self.max_settled_ratio < 1:
            raise ValueError("--settle-s must be >= 0 and --max-settled-ratio >= 1")


# What `--quick` changes: every attack in seconds, for a test.
QUICK_SETTINGS = {"distinct": 6, "enum_values": 2_000, "attackers": 4, "baseline_s": 2.0,
                  "attack_s": 10.0, "rejected_grammars": 4, "settle_s": 3.0}


def attack_body(model: str, repeat: int | None, max_tokens: int) -> dict[str, Any]:
    """A completion whose output must match `(a{1000}){repeat}`: each `repeat` is a
    distinct grammar, so none is served from the grammar cache (None: the same completion
    without a grammar, the control)."""
    body: dict[str, Any] = {"model": model, "prompt": "a", "max_tokens": max_tokens}
    if repeat is not None:
        body["structured_outputs"] = {"regex": f"(a{{1000}}){{{repeat}}}"}
    return body


def enum_body(model: str, index: int, num_values: int) -> dict[str, Any]:
    """A completion whose output must be one of `num_values` strings, distinct by `index`."""
    values = [f"v{index}-{value:06d}-{'x' * 20}" for value in range(num_values)]
    return {"model": model, "prompt": "a", "max_tokens": 1,
            "structured_outputs": {"json": {"enum": values}}}


# Memory.
async def _memory_attack(server: ServerProcess, settings: GrammarAttackSettings
                         ) -> tuple[list[tuple[str, object]], list[Check]]:
    sampler = RssSampler(server, interval_s=0.2)
    start_mib = sampler.sample()
    start_by_process = _rss_by_process(server)
    sampler.start()
    started_s = time.monotonic()
    async with httpx.AsyncClient(base_url=server.base_url, timeout=300.0) as http:
        model = await served_model(http)
        statuses = Counter(
            [await attacker_completion(http, enum_body(model, index, settings.enum_values))
             for index in range(settings.distinct)])
    await sampler.stop()
    end_mib = sampler.sample()
    growth_mib = sampler.peak_rss_mib - start_mib
    figures: list[tuple[str, object]] = [
        ("memory: grammars sent", settings.distinct),
        ("memory: statuses", counts_text(statuses)),
        ("memory: seconds", round(time.monotonic() - started_s, 1)),
        ("memory: server RSS before / peak / after, MiB",
         f"{start_mib:.0f} / {sampler.peak_rss_mib:.0f} / {end_mib:.0f}"),
        ("memory: peak growth, MiB", round(growth_mib, 1)),
        ("memory: RSS before -> after by process, MiB", ", ".join(
            f"{pid}: {start_by_process.get(pid, 0.0):.0f} -> {rss_mib:.0f}"
            for pid, rss_mib in _rss_by_process(server).items())),
    ]
    checks = [
        Check("memory: the server survived", server.is_healthy(), server.log_tail(3)
              if not server.is_healthy() else "healthy"),
        Check("memory: growth within bound", growth_mib <= settings.memory_bound_mib,
              f"{growth_mib:.0f} MiB (bound {settings.memory_bound_mib:.0f})"),
    ]
    return figures, checks


def _rss_by_process(server: ServerProcess) -> dict[int, float]:
    return {pid: read_rss_mib(pid) or 0.0 for pid in server.process_ids()}


# Rejected.
def schema_chat_body(model: str, pattern: str) -> dict[str, Any]:
    """A chat completion whose answer must be a JSON string matching `pattern`."""
    return {"model": model, "messages": [{"role": "user", "content": "a"}], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "answer", "schema": {"type": "string", "pattern": pattern}}}}


async def _schema_chats(http: httpx.AsyncClient, model: str, patterns: list[str]
                        ) -> tuple[Counter[int | str], str]:
    """Sends a chat for each pattern, one after another, as the attacker: the statuses, and
    the error message of the last refused one ("" when none was)."""
    statuses: Counter[int | str] = Counter()
    message = ""
    for pattern in patterns:
        try:
            response = await http.post("/v1/chat/completions", headers=auth(ATTACKER_KEY),
                                       json=schema_chat_body(model, pattern))
        except httpx.HTTPError as error:
            statuses[type(error).__name__] += 1
            continue
        statuses[response.status_code] += 1
        if response.status_code != 200:
            message = str(response.json().get("error", {}).get("message", ""))
    return statuses, message


def engine_core_pid(server: ServerProcess) -> int:
    """The engine core's process: the server's descendant with the most resident memory (the
    others are multiprocessing's resource tracker and short-lived body parsers)."""
    children = server.process_ids()[1:]
    if not children:
        raise RuntimeError("the server has no engine core process")
    return max(children, key=lambda pid: read_rss_mib(pid) or 0.0)


async def _rejected_attack(server: ServerProcess, settings: GrammarAttackSettings
                           ) -> tuple[list[tuple[str, object]], list[Check]]:
    core_pid = engine_core_pid(server)

    def core_rss_mib() -> float:
        return read_rss_mib(core_pid) or 0.0

    ordinary = [f"^[a-z]{{1,{length}}}$" for length in range(8, 8 + settings.rejected_grammars)]
    repeats = [settings.rejected_repeat_base + index * settings.rejected_repeat_step
               for index in range(settings.rejected_grammars)]
    hostile = [f"^(a{{1000}}){{{repeat}}}$" for repeat in repeats]
    async with httpx.AsyncClient(base_url=server.base_url, timeout=300.0) as http:
        model = await served_model(http)
        start_mib = core_rss_mib()
        baseline_statuses, _ = await _schema_chats(http, model, ordinary)
        before_mib = core_rss_mib()
        sampler = RssSampler(server, interval_s=0.1, measure=core_rss_mib)
        sampler.sample()
        sampler.start()
        attack_statuses, message = await _schema_chats(http, model, hostile)
        await sampler.stop()
    after_mib = sampler.sample()
    await asyncio.sleep(settings.settle_s)
    settled_mib = core_rss_mib()
    growth_mib = after_mib - start_mib
    settled_bound_mib = start_mib * settings.max_settled_ratio
    figures: list[tuple[str, object]] = [
        ("rejected: statuses, baseline / attack",
         f"{counts_text(baseline_statuses)} / {counts_text(attack_statuses)}"),
        ("rejected: an attacker's answer", message),
        ("rejected: core RSS start / after baseline / peak / after attack, MiB",
         f"{start_mib:.0f} / {before_mib:.0f} / {sampler.peak_rss_mib:.0f} / {after_mib:.0f}"),
        (f"rejected: core RSS {settings.settle_s:g} s after the attack, MiB",
         round(settled_mib)),
        ("rejected: growth over the start at the attack's end, MiB", round(growth_mib, 1)),
    ]
    checks = [
        Check("rejected: the server survived", server.is_healthy(), ""),
        Check("rejected: every hostile grammar refused with 400",
              attack_statuses == Counter({400: settings.rejected_grammars}),
              counts_text(attack_statuses)),
        Check(f"rejected: core growth within {settings.max_rejected_growth_mib:g} MiB",
              growth_mib <= settings.max_rejected_growth_mib, f"{growth_mib:.0f} MiB"),
        Check(f"rejected: core RSS {settings.settle_s:g} s later within "
              f"{settings.max_settled_ratio:g}x of its start",
              settled_mib <= settled_bound_mib,
              f"{settled_mib:.0f} MiB (bound {settled_bound_mib:.0f})"),
    ]
    return figures, checks


# Stall.
async def _stall_attack(server: ServerProcess, settings: GrammarAttackSettings
                        ) -> tuple[list[tuple[str, object]], list[Check]]:
    victim, stop = Victim(grammar=settings.victim_grammar), asyncio.Event()
    async with httpx.AsyncClient(base_url=server.base_url, timeout=300.0) as http:
        model = await served_model(http)
        victim_task = asyncio.create_task(victim.run(http, model, settings.victim_tokens, stop))
        await asyncio.sleep(settings.baseline_s)
        victim.phase = "attack"
        started_s = time.monotonic()
        attacks = [asyncio.create_task(attacker_completion(http, attack_body(
            model, None if settings.control else settings.stall_repeat_base + index,
            settings.attack_tokens))) for index in range(settings.attackers)]
        done, pending = await asyncio.wait(attacks, timeout=settings.attack_s)
        attack_s = time.monotonic() - started_s
        stop.set()
        for task in pending:
            task.cancel()
        await victim_task
    statuses = Counter(task.result() for task in done)
    statuses["unanswered"] += len(pending)
    figures: list[tuple[str, object]] = [
        ("stall: attackers' statuses", counts_text(statuses)),
        ("stall: attack phase, s", round(attack_s, 1)),
    ]
    victim_figures, checks = victim.figures_and_checks("stall", settings.max_latency_ratio,
                                                       first_token=True)
    return figures + victim_figures, [Check("stall: the server survived",
                                            server.is_healthy(), ""), *checks]


async def _run_attack(server: ServerProcess, attack: str, settings: GrammarAttackSettings
                      ) -> tuple[list[tuple[str, object]], list[Check]]:
    runs = {"memory": _memory_attack, "stall": _stall_attack, "rejected": _rejected_attack}
    return await runs[attack](server, settings)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="every attack in seconds: " + ", ".join(
                            f"{name} {value}" for name, value in QUICK_SETTINGS.items()))
    add_attack_arguments(parser, ATTACKS, GrammarAttackSettings, DEFAULT_SERVE_ARGS)


def main(args: argparse.Namespace) -> int:
    if args.quick:
        defaults = GrammarAttackSettings()
        for name, value in QUICK_SETTINGS.items():
            if getattr(args, name) == getattr(defaults, name):
                setattr(args, name, value)
    return run_attacks(args, ATTACKS, GrammarAttackSettings, _run_attack)
