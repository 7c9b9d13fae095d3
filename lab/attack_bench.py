"""What the attack benchmarks (`python -m lab bodies`, `flood`, `grammars`, `pins`, `streams`)
share: their flags, the run of each attack against its own `continuum serve` subprocess, the report,
and the victim, the well-behaved tenant. The victim streams completions one after another and
times each one's first token and the gaps between its tokens, by phase (alone, then under
attack)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import itertools
import json
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from typing import Any, TypeVar

import httpx

from eval.replay_metrics import percentile
from lab.flags import add_settings_flags, settings_from_args
from lab.load_clients import sse_lines
from lab.server_checks import Check, FiguresReport, run_against_server
from lab.server_process import ServerProcess, add_server_arguments

_Settings = TypeVar("_Settings")
Figures = list[tuple[str, object]]
Attack = Callable[[ServerProcess, str, _Settings], Awaitable[tuple[Figures, list[Check]]]]

VICTIM_KEY, ATTACKER_KEY = "victim-key", "attacker-key"
TENANT_ARGS = ("--tenant", f"victim:{VICTIM_KEY}", "--tenant", f"attacker:{ATTACKER_KEY}")
PHASES = ("baseline", "attack")


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def served_model(http: httpx.AsyncClient) -> str:
    response = await http.get("/v1/models", headers=auth(VICTIM_KEY))
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


async def attacker_completion(http: httpx.AsyncClient, body: dict[str, Any]) -> int | str:
    """POSTs `body` to `/v1/completions` as the attacker: the answer's status, or the name of
    the error that came instead."""
    try:
        response = await http.post("/v1/completions", json=body, headers=auth(ATTACKER_KEY))
        return response.status_code
    except httpx.HTTPError as error:
        return type(error).__name__


@contextlib.asynccontextmanager
async def attacker_process(ready: Callable[[], None]) -> AsyncIterator[ProcessPoolExecutor]:
    """A child process for an attack's clients, with an event loop and HTTP client of their
    own as remote clients would have (sharing the victim's loop, writing their requests would
    delay the victim's client and count as the server's slowness). `ready`, a function of
    the attack's module, runs there first, before the baseline, so that the process has
    started and imported that module when the attack begins."""
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as process:
        await asyncio.get_running_loop().run_in_executor(process, ready)
        yield process


@dataclass
class Victim:
    """The victim's latencies by phase; owned by one run, which sets `phase`. `chat` sends
    chat completions (rendered and tokenized by the server), else text completions.
    `grammar`: each completion's output must match a regex of its own (so that each is
    compiled, none served from the grammar cache), of more characters than it asks tokens
    for, and does not ignore EOS (a constraint may not)."""

    chat: bool = False
    grammar: bool = False
    phase: str = "baseline"
    gaps_s: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PHASES})
    first_token_s: dict[str, list[float]] = field(
        default_factory=lambda: {p: [] for p in PHASES})
    request_s: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PHASES})
    num_failed: int = 0

    async def run(self, http: httpx.AsyncClient, model: str, max_tokens: int,
                  stop: asyncio.Event) -> None:
        body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "stream": True,
                                "ignore_eos": not self.grammar}
        if self.chat:
            body["messages"] = [{"role": "user", "content": "hello"}]
        else:
            body["prompt"] = "hello"
        path = "/v1/chat/completions" if self.chat else "/v1/completions"
        for index in itertools.count():
            if stop.is_set():
                return
            if self.grammar:
                body["structured_outputs"] = {"regex": f"{index} [a-z]{{{2 * max_tokens}}}"}
            try:
                await self._one(http, path, body)
            except httpx.HTTPError:
                self.num_failed += 1

    async def _one(self, http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> None:
        phase, sent_s = self.phase, time.monotonic()
        async with http.stream("POST", path, json=body, headers=auth(VICTIM_KEY)) as response:
            if response.status_code != 200:
                self.num_failed += 1
                return
            last_s = None
            async for line in sse_lines(response.aiter_bytes()):
                if not line.startswith("data: {") or not _chunk_text(line[6:]):
                    continue
                now_s = time.monotonic()
                if last_s is None:
                    self.first_token_s[phase].append(now_s - sent_s)
                else:
                    self.gaps_s[phase].append(now_s - last_s)
                last_s = now_s
            if last_s is not None:
                self.request_s[phase].append(last_s - sent_s)

    def figures_and_checks(self, prefix: str, max_ratio: float, *, first_token: bool,
                           whole_request: bool = False
                           ) -> tuple[list[tuple[str, object]], list[Check]]:
        """Median, p99 and worst of each phase, and checks that the attack phase's median
        and p99 stay within `max_ratio` of the baseline's (also for the first token's time
        when `first_token`, and for the whole completion's when `whole_request`)."""
        figures: list[tuple[str, object]] = [
            (f"{prefix}: victim tokens baseline / attack",
             " / ".join(str(len(self.gaps_s[p])) for p in PHASES)),
            (f"{prefix}: victim failures", self.num_failed)]
        checks: list[Check] = []
        measures = [("inter-token", self.gaps_s)]
        if first_token:
            measures.append(("time to first token", self.first_token_s))
        if whole_request:
            measures.append(("completion time", self.request_s))
        for measure, by_phase in measures:
            baseline, attack = by_phase["baseline"], by_phase["attack"]
            for name, q in (("median", 50.0), ("p99", 99.0)):
                before, during = percentile(baseline, q), percentile(attack, q)
                figures.append((f"{prefix}: victim {measure} {name}, ms (baseline / attack)",
                                f"{ms_text(before)} / {ms_text(during)}"))
                ratio = None if not before or during is None else during / before
                checks.append(Check(f"{prefix}: victim {measure} {name} within {max_ratio}x",
                                    ratio is not None and ratio <= max_ratio,
                                    "no tokens" if ratio is None else f"{ratio:.2f}x"))
            figures.append((f"{prefix}: victim {measure} worst, ms (baseline / attack)",
                            f"{ms_text(max(baseline, default=None))} / "
                            f"{ms_text(max(attack, default=None))}"))
        return figures, checks


def _chunk_text(data: str) -> str:
    """The text a streamed chunk adds (a completion's `text`, a chat's `delta.content`)."""
    choices = json.loads(data).get("choices") or [{}]
    choice = choices[0]
    return str(choice.get("text") or (choice.get("delta") or {}).get("content") or "")


def ms_text(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def counts_text(counter: Counter[Any]) -> str:
    return ", ".join(f"{key}: {count}" for key, count in sorted(counter.items(), key=str)
                     if count)


def add_attack_arguments(parser: argparse.ArgumentParser, attacks: Sequence[str],
                         settings_type: type, serve_args: Sequence[str]) -> None:
    """`--attack` (one of `attacks`, or all of them; none if there is one), a flag for each
    setting of `settings_type` (`lab.flags`), the server flags and `--json`."""
    if len(attacks) > 1:
        parser.add_argument("--attack", choices=(*attacks, "all"), default="all",
                            help="which attack to run (default: %(default)s)")
    add_settings_flags(parser, settings_type)
    add_server_arguments(parser, serve_args)
    parser.add_argument("--json", default=None, help="write the figures and checks here")


def run_attacks(args: argparse.Namespace, attacks: Sequence[str],
                settings_type: Callable[..., _Settings], attack: Attack[_Settings]) -> int:
    """Runs the chosen attacks, each against a server of its own (`run_against_server`),
    prints the figures and checks (and writes them to `--json`); the command's exit status:
    0 if every check passed, 1 if one failed or a server did not start, 2 for bad flags."""
    try:
        settings = settings_from_args(settings_type, args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    chosen = getattr(args, "attack", "all")
    runs = [functools.partial(_attack_report, attack, name, settings)
            for name in (attacks if chosen == "all" else (chosen,))]
    return run_against_server(args, runs, check_invariants=False,
                              context={"settings": dataclasses.asdict(settings)})


def _attack_report(attack: Attack[_Settings], name: str, settings: _Settings,
                   server: ServerProcess) -> FiguresReport:
    figures, checks = asyncio.run(attack(server, name, settings))
    return FiguresReport(tuple(figures), tuple(checks))
