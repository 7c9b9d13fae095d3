"""`python -m lab bodies`: one tenant's huge request and response bodies against a
`continuum serve` subprocess (loopback, two tenants), measured from the other tenant.

The victim streams chat completions one after another and times each one's first token and
the gaps between its tokens, first alone for `--baseline-s`, then for `--attack-s` while
`--attackers` clients of the other tenant each send one request after another
(`--attack chats|responses|held|retrievals|logprobs|tools|blocks|all`, each against its own
server):
- **chats**: chats of `--chat-messages` messages of `--message-chars` characters (8 MB by
  default), each taking seconds to render and tokenize (in the server's parse children, on
  cores it shares with every tenant); longer than the model's context, so each ends in a 400
  once tokenized.
- **responses**: Responses requests whose one input message holds `--response-parts` tiny
  content parts (15 MB by default), costly to parse and validate on the event loop.
- **held**: instead of `--attackers` clients, `--held-bodies` connections, each declaring a
  completion body of `--held-body-bytes` (16 MB by default) and sending all of it but its
  last byte, then holding on until the server answers (at its body timeout, or at once if
  it refuses the body); each, once answered, opens again after `--reopen-s`, until a
  second before the attack ends. A server that holds every body it is sent grows by all
  of them. Check: the server process's resident memory at its peak over its level at the
  attack's start is at most `--max-rss-growth-mib`.
- **retrievals**: before the baseline, the attacker stores one response of
  `--retrieval-tokens` tokens with 20 top logprobs each (5.5 MB of JSON by default); the
  attackers then `GET /v1/responses/{id}` it one after another.
- **logprobs**: completions with `echo`, `logprobs` 20 and `max_tokens` 0 over
  `--echo-prompts` prompts of `--echo-prompt-tokens` tokens each, `n` `--echo-n`: a 32 KB
  body whose answer, were the prompts' logprobs copied into every choice, would be 167 MB
  (the default's).
- **tools**: Messages API `count_tokens` requests offering `--tools` tools (40 KB by
  default), each name checked against the others.
- **blocks**: Messages API requests whose system prompt holds `--system-blocks` one-letter
  text blocks (12 MB by default), past the limit on a conversation's blocks.
The attackers run in a child process with an event loop and HTTP client of their own, as
remote clients would: sharing the victim's loop, writing their megabytes would delay the
victim's client itself and count as the server's slowness. The victim's attack phase is the
`--attack-s` in which the attackers keep sending, not the time the server takes to answer
their last bodies, so that a server that answers them sooner is not measured over a shorter
and denser phase. Figures: the victim's time to first token and inter-token latency (median,
p99, worst) in both phases, the attackers' statuses and their process's CPU (on the same
cores as the server's; `--attackers-nice 19` gives it little of the CPU the others want, as
if it ran on another machine). Check: the victim's medians and
p99s stay within `--max-latency-ratio` of the baseline's. Every attack also reports the
server process's resident memory at its peak in the attack, over its level at the start.

Exit status 1 if a check failed or a server did not start, 2 for bad flags.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx

from lab.attack_bench import (
    ATTACKER_KEY,
    TENANT_ARGS,
    Victim,
    add_attack_arguments,
    attacker_process,
    auth,
    counts_text,
    run_attacks,
    served_model,
)
from lab.flags import bench_setting
from lab.server_checks import Check, RssSampler
from lab.server_process import ServerProcess, read_rss_mib

# The context holds the retrievals' and logprobs' 4,000-token texts; the pool, one logprobs
# request's eight prompts at once.
DEFAULT_SERVE_ARGS = ("--num-kv-blocks", "2560", "--max-model-len", "4096",
                      "--no-job-inference", *TENANT_ARGS)
ATTACKS = ("chats", "responses", "held", "retrievals", "logprobs", "tools", "blocks")
TOP_LOGPROBS = 20
RSS_SAMPLE_INTERVAL_S = 0.2
HOLDER_LAST_OPEN_S = 1.0


@dataclass(frozen=True)
class BodyAttackSettings:
    """The flags of a run (see the module docstring)."""

    attackers: int = bench_setting(12, "attacking clients, each sending one body after another")
    chat_messages: int = bench_setting(2_000, "chats: messages of each chat")
    message_chars: int = bench_setting(4_000, "chats: characters of each message")
    response_parts: int = bench_setting(400_000, "responses: content parts of the input message")
    baseline_s: float = bench_setting(8.0, "seconds the victim runs alone first")
    attack_s: float = bench_setting(30.0, "seconds of attack")
    held_bodies: int = bench_setting(64, "held: connections each holding a body one byte short")
    held_body_bytes: int = bench_setting(16_000_000, "held: the declared length of each held body")
    reopen_s: float = bench_setting(1.0,
        "held: seconds before a connection, once answered, opens again")
    victim_tokens: int = bench_setting(32, "tokens of each victim completion")
    max_latency_ratio: float = bench_setting(1.5,
        "most victim latency under attack over its baseline")
    max_rss_growth_mib: float = bench_setting(512.0,
        "held: most growth of the server process's memory")
    attackers_nice: int = bench_setting(0,
        "the attackers' process's niceness: 19 gives it little of the CPU that the server's "
        "processes and the victim want, as if it ran on another machine")
    retrieval_tokens: int = bench_setting(4_000, "retrievals: tokens of the stored response")
    echo_prompts: int = bench_setting(8, "logprobs: prompts of each completion")
    echo_prompt_tokens: int = bench_setting(4_000, "logprobs: tokens of each prompt")
    echo_n: int = bench_setting(16, "logprobs: completions of each prompt")
    tools: int = bench_setting(1_024, "tools: tools each count_tokens request offers")
    system_blocks: int = bench_setting(480_000,
        "blocks: text blocks of each request's system prompt")

    def __post_init__(self) -> None:
        if min(self.attackers, self.chat_messages, self.message_chars, self.response_parts,
               self.held_bodies, self.victim_tokens, self.retrieval_tokens, self.echo_prompts,
               self.echo_prompt_tokens, self.echo_n, self.tools,
               self.system_blocks) < 1 or self.held_body_bytes < 1024:
            raise ValueError("counts must be >= 1 (--held-body-bytes >= 1024)")
        if min(self.baseline_s, self.attack_s, self.max_latency_ratio,
               self.max_rss_growth_mib) <= 0 or self.reopen_s < 0:
            raise ValueError("durations, ratios and memory must be positive")
        if not 0 <= self.attackers_nice <= 19:
            raise ValueError("--attackers-nice must be in [0, 19]")


def attack_request(attack: str, model: str, settings: BodyAttackSettings
                   ) -> tuple[str, bytes]:
    """The path and JSON body each attacker sends, distinct per attack (for `held`, all of a
    body of `held_body_bytes` but its last byte, the closing brace; for `retrievals`, the
    request that stores the response the attackers then fetch)."""
    if attack == "retrievals":
        body: dict[str, object] = {
            "model": model, "input": "hello", "max_output_tokens": settings.retrieval_tokens,
            "ignore_eos": True, "include": ["message.output_text.logprobs"],
            "top_logprobs": TOP_LOGPROBS}
        return "/v1/responses", json.dumps(body).encode()
    if attack == "logprobs":
        # The tiny model's tokenizer reads bytes: each prompt is about its characters' tokens.
        prompts = [f"{index} " + "a" * (settings.echo_prompt_tokens - len(f"{index} "))
                   for index in range(settings.echo_prompts)]
        body = {"model": model, "prompt": prompts, "echo": True, "logprobs": TOP_LOGPROBS,
                "max_tokens": 0, "n": settings.echo_n}
        return "/v1/completions", json.dumps(body).encode()
    if attack == "chats":
        text = "lorem ipsum " * (settings.message_chars // 12)
        messages = [{"role": "user" if index % 2 else "assistant", "content": f"{index} {text}"}
                    for index in range(settings.chat_messages)]
        body = {"model": model, "max_tokens": 1, "messages": messages}
        return "/v1/chat/completions", json.dumps(body).encode()
    if attack == "tools":
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"name": f"tool_{index}", "input_schema": {"type": "object"}}
                          for index in range(settings.tools)]}
        return "/v1/messages/count_tokens", json.dumps(body).encode()
    if attack == "blocks":
        body = {"model": model, "max_tokens": 1,
                "system": [{"type": "text", "text": "a"}] * settings.system_blocks,
                "messages": [{"role": "user", "content": "hi"}]}
        return "/v1/messages", json.dumps(body).encode()
    if attack == "held":
        prefix = f'{{"model": "{model}", "prompt": "hi", "max_tokens": 1'.encode()
        return "/v1/completions", prefix + b" " * (settings.held_body_bytes - len(prefix) - 1)
    part = {"type": "input_text", "text": "a"}
    body = {"model": model, "max_output_tokens": 1,
            "input": [{"role": "user", "content": [part] * settings.response_parts}]}
    return "/v1/responses", json.dumps(body).encode()


async def _attacker(http: httpx.AsyncClient, path: str, body: bytes | None, until_s: float,
                    statuses: Counter[int | str]) -> None:
    """Sends `body` to `path` (a GET when it is None) one request after another until
    `until_s` (monotonic), counting the answers' statuses."""
    headers = {**auth(ATTACKER_KEY), "Content-Type": "application/json"}
    while time.monotonic() < until_s:
        try:
            if body is None:
                response = await http.get(path, headers=headers)
            else:
                response = await http.post(path, content=body, headers=headers)
            statuses[response.status_code] += 1
        except httpx.HTTPError as error:
            statuses[type(error).__name__] += 1


async def _holder(address: tuple[str, int], path: str, body: bytes, until_s: float,
                  reopen_s: float, statuses: Counter[int | str]) -> None:
    """Holds one connection at a time that sent `body`, one byte short of its declared
    length, until the server answers or `until_s` (monotonic) passes; opens none in the
    attack's last `HOLDER_LAST_OPEN_S`, so that "held to the end" means held."""
    head = (f"POST {path} HTTP/1.1\r\nHost: {address[0]}\r\n"
            f"Authorization: Bearer {ATTACKER_KEY}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body) + 1}\r\n\r\n").encode()
    while until_s - time.monotonic() > HOLDER_LAST_OPEN_S:
        try:
            status = await asyncio.wait_for(_hold_once(address, head, body),
                                            until_s - time.monotonic())
        except asyncio.TimeoutError:
            status = "held to the end"
        except OSError as error:
            status = type(error).__name__
        statuses[status] += 1
        await asyncio.sleep(min(reopen_s, max(0.0, until_s - time.monotonic())))


async def _hold_once(address: tuple[str, int], head: bytes, body: bytes) -> int | str:
    """Opens a connection, sends `head` and `body` and waits for the answer: its status."""
    reader, writer = await asyncio.open_connection(*address)
    sending = asyncio.ensure_future(_send(writer, head, body))
    # Its error, if any (the server may close before the body is written), is the answer's
    # or the read's.
    sending.add_done_callback(lambda task: task.cancelled() or task.exception())
    try:
        return _status(await reader.readline())
    finally:
        sending.cancel()
        writer.close()


def _status(status_line: bytes) -> int | str:
    """The status of an HTTP response's first line; "closed" for none, "malformed" for one
    that is not a status line."""
    if not status_line:
        return "closed"
    parts = status_line.split()
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else "malformed"


async def _send(writer: asyncio.StreamWriter, head: bytes, body: bytes) -> None:
    """`head`, then `body` a MiB at a time as the socket takes it (not all of it buffered in
    this process at once for each connection)."""
    writer.write(head)
    view = memoryview(body)
    for offset in range(0, len(body), 1 << 20):
        writer.write(view[offset:offset + (1 << 20)])
        await writer.drain()


@dataclass(frozen=True)
class AttackersRun:
    """What the attackers' child process did: the count of each status or error of its
    requests, and its own CPU seconds (all its threads, user and system) over `wall_s`."""

    statuses: Counter[int | str]
    cpu_s: float
    wall_s: float


def _timed_run(attack: Callable[[Counter[int | str]], Awaitable[None]],
               settings: BodyAttackSettings) -> AttackersRun:
    """Runs `attack` (which counts its statuses) on a new event loop, at niceness
    `settings.attackers_nice` at least, with its CPU and wall time."""
    # Only ever raised: lowering a niceness the bench was started with needs privileges.
    niceness = max(os.getpriority(os.PRIO_PROCESS, 0), settings.attackers_nice)
    os.setpriority(os.PRIO_PROCESS, 0, niceness)
    statuses: Counter[int | str] = Counter()
    cpu_start_s, start_s = time.process_time(), time.monotonic()
    asyncio.run(attack(statuses))
    return AttackersRun(statuses, time.process_time() - cpu_start_s,
                        time.monotonic() - start_s)


def run_holders(base_url: str, path: str, body: bytes, settings: BodyAttackSettings
                ) -> AttackersRun:
    """`settings.held_bodies` connections each holding a body (`_holder`) for
    `settings.attack_s` seconds. Runs in the attackers' child process."""

    async def hold_all(statuses: Counter[int | str]) -> None:
        until_s = time.monotonic() + settings.attack_s
        host, port = base_url.removeprefix("http://").rsplit(":", 1)
        await asyncio.gather(*(_holder((host, int(port)), path, body, until_s,
                                       settings.reopen_s, statuses)
                               for _ in range(settings.held_bodies)))

    return _timed_run(hold_all, settings)


def attackers_ready() -> None:
    """Run once in the attackers' child process before the baseline, so that it has imported
    this module when the attack starts."""


def store_response(base_url: str, path: str, body: bytes) -> tuple[str, int]:
    """Creates the response the `retrievals` attack fetches: its id, and the size of the
    stored JSON, bytes. Runs in the attackers' child process before the baseline."""
    with httpx.Client(base_url=base_url, timeout=600.0) as http:
        headers = {**auth(ATTACKER_KEY), "Content-Type": "application/json"}
        created = http.post(path, content=body, headers=headers)
        created.raise_for_status()
        response_id = str(created.json()["id"])
        stored = http.get(f"{path}/{response_id}", headers=headers)
        stored.raise_for_status()
        return response_id, len(stored.content)


def run_attackers(base_url: str, path: str, body: bytes | None, settings: BodyAttackSettings
                  ) -> AttackersRun:
    """`settings.attackers` clients each sending `body` to `path` one after another for
    `settings.attack_s` seconds (each request let finish; a GET of `path` when `body` is
    None). Runs in the attackers' child process."""

    async def attack_all(statuses: Counter[int | str]) -> None:
        until_s = time.monotonic() + settings.attack_s
        async with httpx.AsyncClient(base_url=base_url, timeout=300.0) as http:
            await asyncio.gather(*(_attacker(http, path, body, until_s, statuses)
                                   for _ in range(settings.attackers)))

    return _timed_run(attack_all, settings)


async def _attack(server: ServerProcess, attack: str, settings: BodyAttackSettings
                  ) -> tuple[list[tuple[str, object]], list[Check]]:
    victim, stop = Victim(chat=True), asyncio.Event()
    loop = asyncio.get_running_loop()
    async with (attacker_process(attackers_ready) as attackers,
                httpx.AsyncClient(base_url=server.base_url, timeout=300.0) as http):
        model = await served_model(http)
        path, body = attack_request(attack, model, settings)
        attack_path, attack_body, body_figure = path, body, (
            f"{attack}: attack body, MB", round(len(body) / 1e6, 1))
        if attack == "retrievals":
            response_id, num_stored_bytes = await loop.run_in_executor(
                attackers, store_response, server.base_url, path, body)
            attack_path, attack_body = f"{path}/{response_id}", None
            body_figure = (f"{attack}: stored response, MB", round(num_stored_bytes / 1e6, 1))
        victim_task = asyncio.create_task(
            victim.run(http, model, settings.victim_tokens, stop))
        baseline_cpu = _CpuReading.of(server)
        await asyncio.sleep(settings.baseline_s)
        victim.phase = "attack"
        attack_cpu = _CpuReading.of(server)
        attack_done = loop.run_in_executor(
            attackers, run_holders if attack == "held" else run_attackers,
            server.base_url, attack_path, attack_body, settings)
        # The victim is measured over the same window whatever the server makes of the
        # attack: the attackers' last requests may take from seconds to minutes more.
        rss_growth_mib = await _peak_rss_growth_mib(server, settings.attack_s)
        end_cpu = _CpuReading.of(server)
        stop.set()
        await victim_task
        attackers_run = await attack_done
    figures: list[tuple[str, object]] = [
        body_figure,
        (f"{attack}: attackers' statuses", counts_text(attackers_run.statuses)),
        (f"{attack}: attackers' process CPU, % of a core",
         round(100 * attackers_run.cpu_s / attackers_run.wall_s, 1)),
        *_server_cpu_figures(attack, baseline_cpu, attack_cpu, end_cpu),
        (f"{attack}: server process RSS peak growth in the attack, MiB",
         "not read" if rss_growth_mib is None else round(rss_growth_mib, 1)),
    ]
    victim_figures, checks = victim.figures_and_checks(attack, settings.max_latency_ratio,
                                                       first_token=True)
    checks.insert(0, Check(f"{attack}: the server survived", server.is_healthy(), ""))
    if attack == "held":
        checks.append(Check(
            f"{attack}: server RSS growth at most {settings.max_rss_growth_mib} MiB",
            rss_growth_mib is not None and rss_growth_mib <= settings.max_rss_growth_mib,
            "not read" if rss_growth_mib is None else f"{rss_growth_mib:.1f} MiB"))
    return figures + victim_figures, checks


async def _peak_rss_growth_mib(server: ServerProcess, duration_s: float) -> float | None:
    """The server process's (not its descendants') resident memory at its highest over
    `duration_s` seconds from now, over its level now, MiB; None if it was not read."""
    sampler = RssSampler(server, RSS_SAMPLE_INTERVAL_S,
                         measure=lambda: read_rss_mib(server.pid) or 0.0)
    start_mib = sampler.sample()
    sampler.start()
    await asyncio.sleep(duration_s)
    await sampler.stop()
    return None if not start_mib else sampler.peak_rss_mib - start_mib


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
    add_attack_arguments(parser, ATTACKS, BodyAttackSettings, DEFAULT_SERVE_ARGS)


def main(args: argparse.Namespace) -> int:
    return run_attacks(args, ATTACKS, BodyAttackSettings, _attack)
