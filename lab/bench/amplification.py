"""`python -m lab amplification`: the resident memory of a `continuum serve` subprocess's
processes (frontend, resource tracker, engine core) before and after one huge completion
request.

By default the request is the 13.6 MB body of the memory-amplification reproduction: 4
prompts, `n` 16, 16 stop strings of 850,000 characters each. Before the hardening, such a
body grew the core by about 1 GB, as every one of the 64 engine requests carried its own copy
of the stop strings. Reports the response's status and the body's size, then each process's
memory before and after (`run_against_server`, the lab's harness); exit status 1 if the
request was not answered 200 or the server did not start.
"""

from __future__ import annotations

import argparse
import string
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from lab.flags import add_settings_flags, bench_setting, settings_from_args
from lab.server_checks import Check, FiguresReport, run_against_server
from lab.server_process import ServerProcess, add_server_arguments, read_rss_mib

DEFAULT_SERVE_ARGS = ("--num-kv-blocks", "512")
_MAX_DISTINCT = len(string.ascii_lowercase)  # one letter per prompt and per stop string


@dataclass(frozen=True)
class AmplificationSettings:
    """The one completion request: its prompts, completions and stop strings."""

    prompts: int = bench_setting(4, "prompts of the request, 'a', 'b', ...")
    n: int = bench_setting(16, "completions of each prompt", option="-n")
    stop_strings: int = bench_setting(16, "stop strings, 'AAA...', 'BBB...', ...")
    stop_chars: int = bench_setting(850_000, "characters of each stop string")
    max_tokens: int = bench_setting(4, "tokens of each completion")
    model: str = bench_setting("tiny", "the served model")

    def __post_init__(self) -> None:
        for flag, count in (("--prompts", self.prompts), ("--stop-strings", self.stop_strings)):
            if not 1 <= count <= _MAX_DISTINCT:
                raise ValueError(f"{flag} must be in [1, {_MAX_DISTINCT}], got {count}")
        if min(self.n, self.stop_chars, self.max_tokens) < 1:
            raise ValueError("-n, --stop-chars and --max-tokens must be >= 1")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_flags(parser, AmplificationSettings)
    add_server_arguments(parser, DEFAULT_SERVE_ARGS)
    parser.add_argument("--json", default=None, help="write the figures and checks here")


def request_body(settings: AmplificationSettings) -> dict[str, Any]:
    """The completion request `settings` describe."""
    return {"model": settings.model, "prompt": list(string.ascii_lowercase[:settings.prompts]),
            "n": settings.n, "max_tokens": settings.max_tokens,
            "stop": [letter * settings.stop_chars
                     for letter in string.ascii_uppercase[:settings.stop_strings]]}


def main(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(AmplificationSettings, args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return run_against_server(args, lambda server: send_and_measure(server, request_body(
        settings)), check_invariants=False, context={"settings": asdict(settings)})


def send_and_measure(server: ServerProcess, body: dict[str, Any]) -> FiguresReport:
    """Sends `body` to the started `server`; the response's status, the body's size and its
    processes' memory before and after, checked for a 200."""
    pids = server.process_ids()
    before = {pid: read_rss_mib(pid) for pid in pids}
    response = httpx.post(server.base_url + "/v1/completions", json=body, timeout=300)
    after = {pid: read_rss_mib(pid) for pid in pids}
    rows: list[tuple[str, object]] = [("status", response.status_code),
                                      ("body MB", round(len(str(body)) / 1e6, 1))]
    rows += [(f"{pid} {_command_line(pid)}", f"{_mib(before[pid])} -> {_mib(after[pid])} MiB")
             for pid in pids]
    return FiguresReport(tuple(rows), (Check("answered 200", response.status_code == 200,
                                             f"status {response.status_code}"),))


def _command_line(pid: int) -> str:
    """The first 60 characters of the process's command line, its program by name only (a
    long path to the interpreter would hide its arguments); empty once it is gone."""
    try:
        words = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
    except FileNotFoundError:
        return ""
    return " ".join([Path(words[0]).name, *words[1:]]).strip()[:60]


def _mib(rss_mib: float | None) -> str:
    return "gone" if rss_mib is None else f"{rss_mib:.1f}"
