"""`continuum bench bodies`: one tenant's huge request bodies against a `continuum serve`
subprocess (loopback, two tenants), measured from the other tenant.

The victim streams chat completions one after another and times each one's first token and
the gaps between its tokens, first alone for `--baseline-s`, then for `--attack-s` while
`--attackers` clients of the other tenant each send one body after another
(`--attack chats|responses|both`, each against its own server):
- **chats**: chats of `--chat-messages` messages of `--message-chars` characters (8 MB by
  default), each taking seconds to render and tokenize (in the server's parse children, on
  cores it shares with every tenant); longer than the model's context, so each ends in a 400
  once tokenized.
- **responses**: Responses requests whose one input message holds `--response-parts` tiny
  content parts (15 MB by default), costly to parse and validate on the event loop.
The attackers run in a child process with an event loop and HTTP client of their own, as
remote clients would: sharing the victim's loop, writing their megabytes would delay the
victim's client itself and count as the server's slowness. The victim's attack phase is the
`--attack-s` in which the attackers keep sending, not the time the server takes to answer
their last bodies, so that a server that answers them sooner is not measured over a shorter
and denser phase. Figures: the victim's time to first token and inter-token latency (median,
p99, worst) in both phases and the attackers' statuses. Check: the victim's medians and
p99s stay within `--max-latency-ratio` of the baseline's.

Exit status 1 if a check failed or a server did not start, 2 for bad flags.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context

import httpx

from eval.attack_bench import (
    ATTACKER_KEY,
    TENANT_ARGS,
    Victim,
    add_attack_arguments,
    auth,
    counts_text,
    run_attacks,
    served_model,
)
from eval.server_checks import Check
from eval.server_process import ServerProcess

DEFAULT_SERVE_ARGS = ("--num-kv-blocks", "512", "--max-model-len", "1024",
                      "--no-job-inference", *TENANT_ARGS)
ATTACKS = ("chats", "responses")


@dataclass(frozen=True)
class BodyAttackSettings:
    """The flags of a run (see the module docstring)."""

    attackers: int = 12
    chat_messages: int = 2_000
    message_chars: int = 4_000
    response_parts: int = 400_000
    baseline_s: float = 8.0
    attack_s: float = 30.0
    victim_tokens: int = 32
    max_latency_ratio: float = 1.5

    def __post_init__(self) -> None:
        if min(self.attackers, self.chat_messages, self.message_chars, self.response_parts,
               self.victim_tokens) < 1:
            raise ValueError("counts must be >= 1")
        if min(self.baseline_s, self.attack_s, self.max_latency_ratio) <= 0:
            raise ValueError("durations and ratios must be positive")


def attack_request(attack: str, model: str, settings: BodyAttackSettings
                   ) -> tuple[str, bytes]:
    """The path and JSON body each attacker sends, distinct per attack."""
    if attack == "chats":
        text = "lorem ipsum " * (settings.message_chars // 12)
        messages = [{"role": "user" if index % 2 else "assistant", "content": f"{index} {text}"}
                    for index in range(settings.chat_messages)]
        body: dict[str, object] = {"model": model, "max_tokens": 1, "messages": messages}
        return "/v1/chat/completions", json.dumps(body).encode()
    part = {"type": "input_text", "text": "a"}
    body = {"model": model, "max_output_tokens": 1,
            "input": [{"role": "user", "content": [part] * settings.response_parts}]}
    return "/v1/responses", json.dumps(body).encode()


async def _attacker(http: httpx.AsyncClient, path: str, body: bytes, until_s: float,
                    statuses: Counter[int | str]) -> None:
    headers = {**auth(ATTACKER_KEY), "Content-Type": "application/json"}
    while time.monotonic() < until_s:
        try:
            response = await http.post(path, content=body, headers=headers)
            statuses[response.status_code] += 1
        except httpx.HTTPError as error:
            statuses[type(error).__name__] += 1


def attackers_ready() -> None:
    """Run once in the attackers' child process before the baseline, so that it has imported
    this module when the attack starts."""


def run_attackers(base_url: str, path: str, body: bytes, settings: BodyAttackSettings
                  ) -> Counter[int | str]:
    """`settings.attackers` clients each sending `body` to `path` one after another for
    `settings.attack_s` seconds (each request let finish); the count of each status or
    error. Runs in the attackers' child process."""

    async def attack_all() -> Counter[int | str]:
        statuses: Counter[int | str] = Counter()
        until_s = time.monotonic() + settings.attack_s
        async with httpx.AsyncClient(base_url=base_url, timeout=300.0) as http:
            await asyncio.gather(*(_attacker(http, path, body, until_s, statuses)
                                   for _ in range(settings.attackers)))
        return statuses

    return asyncio.run(attack_all())


async def _attack(server: ServerProcess, attack: str, settings: BodyAttackSettings
                  ) -> tuple[list[tuple[str, object]], list[Check]]:
    victim, stop = Victim(chat=True), asyncio.Event()
    loop = asyncio.get_running_loop()
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as attackers:
        # Started before the baseline, so that its start-up is not part of the attack.
        await loop.run_in_executor(attackers, attackers_ready)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300.0) as http:
            model = await served_model(http)
            path, body = attack_request(attack, model, settings)
            victim_task = asyncio.create_task(
                victim.run(http, model, settings.victim_tokens, stop))
            baseline_cpu = _CpuReading.of(server)
            await asyncio.sleep(settings.baseline_s)
            victim.phase = "attack"
            attack_cpu = _CpuReading.of(server)
            attack_done = loop.run_in_executor(
                attackers, run_attackers, server.base_url, path, body, settings)
            # The victim is measured over the same window whatever the server makes of the
            # attack: the attackers' last requests may take from seconds to minutes more.
            await asyncio.sleep(settings.attack_s)
            end_cpu = _CpuReading.of(server)
            stop.set()
            await victim_task
            statuses = await attack_done
    figures: list[tuple[str, object]] = [
        (f"{attack}: attack body, MB", round(len(body) / 1e6, 1)),
        (f"{attack}: attackers' statuses", counts_text(statuses)),
        *_server_cpu_figures(attack, baseline_cpu, attack_cpu, end_cpu),
    ]
    victim_figures, checks = victim.figures_and_checks(attack, settings.max_latency_ratio,
                                                       first_token=True)
    return figures + victim_figures, [Check(f"{attack}: the server survived",
                                            server.is_healthy(), ""), *checks]


@dataclass(frozen=True)
class _CpuReading:
    """The server process's (user, system) CPU seconds (None once it is gone) at `at_s`
    (monotonic seconds)."""

    at_s: float
    cpu_s: tuple[float, float] | None

    @classmethod
    def of(cls, server: ServerProcess) -> _CpuReading:
        return cls(time.monotonic(), server.cpu_s())


def _server_cpu_figures(attack: str, baseline: _CpuReading, attack_start: _CpuReading,
                        attack_end: _CpuReading) -> list[tuple[str, object]]:
    """The server process's CPU (its event loop and threads; not the engine core nor the
    parse children) in each phase, from readings at each phase's start and the attack's end."""
    if baseline.cpu_s is None or attack_start.cpu_s is None or attack_end.cpu_s is None:
        return [(f"{attack}: server process CPU", "not read: the server is gone")]

    def percent_of_a_core(start: _CpuReading, end: _CpuReading) -> float:
        used_s = sum(end.cpu_s or ()) - sum(start.cpu_s or ())
        return round(100 * used_s / (end.at_s - start.at_s), 1)

    attack_user_s, attack_system_s = (end - start for start, end in
                                      zip(attack_start.cpu_s, attack_end.cpu_s, strict=True))
    return [
        (f"{attack}: server process CPU, % of a core (baseline / attack)",
         f"{percent_of_a_core(baseline, attack_start)} / "
         f"{percent_of_a_core(attack_start, attack_end)}"),
        (f"{attack}: server process CPU in the attack, s (user / system)",
         f"{attack_user_s:.2f} / {attack_system_s:.2f}"),
    ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_attack_arguments(parser, ATTACKS, BodyAttackSettings(), (
        ("attackers", "attacking clients, each sending one body after another"),
        ("chat_messages", "chats: messages of each chat"),
        ("message_chars", "chats: characters of each message"),
        ("response_parts", "responses: content parts of the input message"),
        ("baseline_s", "seconds the victim runs alone first"),
        ("attack_s", "seconds of attack"),
        ("victim_tokens", "tokens of each victim completion"),
        ("max_latency_ratio", "most victim latency under attack over its baseline"),
    ), DEFAULT_SERVE_ARGS)


def main(args: argparse.Namespace) -> int:
    return run_attacks(args, ATTACKS, BodyAttackSettings, _attack)
