"""`python -m lab streams`: the API server's memory around long completion streams with
`logprobs`, against a `continuum serve` subprocess (loopback).

The client sends `--streams` streamed completions at once, each of `--tokens` tokens
(`ignore_eos`) with `--logprobs` top logprobs a token. `--late-readers` of them are not read
while the tokens are generated: their client reads the whole stream only once the others
ended, so that the server holds their chunks meanwhile. Figures: the API server's resident
memory (the `serve` process, not the engine core) at its start, at its peak during the
streams, when they have all ended, and `--settle-s` later; the streams' statuses and tokens.
Checks: every stream ended with `[DONE]` after `--tokens` tokens, and the API server's memory
`--settle-s` after the streams is at most `--max-settled-ratio` times its start.

Exit status 1 if a check failed or the server did not start, 2 for bad flags.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from lab.attack_bench import Figures, add_attack_arguments, run_attacks
from lab.flags import bench_setting
from lab.server_checks import Check
from lab.server_process import ServerProcess, read_rss_mib

ATTACKS = ("streams",)
DEFAULT_SERVE_ARGS = ("--num-kv-blocks", "512", "--max-model-len", "2048")
_SAMPLE_INTERVAL_S = 0.2


@dataclass(frozen=True)
class StreamSettings:
    """The flags of a run (see the module docstring)."""

    streams: int = bench_setting(2, "streamed completions sent at once")
    tokens: int = bench_setting(1024, "tokens of each stream")
    logprobs: int = bench_setting(20, "top logprobs of each token")
    late_readers: int = bench_setting(1, "streams read only once the others ended")
    settle_s: float = bench_setting(10.0,
        "seconds after the streams when the server's memory is read again")
    max_settled_ratio: float = bench_setting(1.1,
        "most API server RSS --settle-s after the streams over its start")
    model: str = bench_setting("tiny", "the served model")

    def __post_init__(self) -> None:
        if min(self.streams, self.tokens) < 1 or self.logprobs < 0:
            raise ValueError("--streams and --tokens must be >= 1, --logprobs >= 0")
        if not 0 <= self.late_readers <= self.streams:
            raise ValueError("--late-readers must be in [0, --streams]")
        if self.settle_s < 0 or self.max_settled_ratio < 1:
            raise ValueError("--settle-s must be >= 0 and --max-settled-ratio >= 1")


@dataclass(frozen=True)
class StreamResult:
    """How one stream ended: its HTTP status (or the client error's name), the tokens its
    chunks carried, and whether it ended with `[DONE]`."""

    status: int | str
    num_tokens: int
    done: bool


def stream_body(settings: StreamSettings, index: int) -> dict[str, Any]:
    """The streamed completion of stream `index` (each has its own prompt)."""
    return {"model": settings.model, "prompt": f"stream {index}:", "stream": True,
            "max_tokens": settings.tokens, "ignore_eos": True, "logprobs": settings.logprobs}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_attack_arguments(parser, ATTACKS, StreamSettings, DEFAULT_SERVE_ARGS)


def main(args: argparse.Namespace) -> int:
    return run_attacks(args, ATTACKS, StreamSettings, measure_streams)


async def measure_streams(server: ServerProcess, attack: str, settings: StreamSettings
                          ) -> tuple[Figures, list[Check]]:
    """Runs the streams (`attack`, this bench's one) against the started `server`: the
    figures (name, value) and the checks."""
    def server_rss_mib() -> float:
        return read_rss_mib(server.pid) or 0.0

    start_mib = server_rss_mib()
    peak_mib = start_mib
    readers_done = asyncio.Event()
    async with httpx.AsyncClient(base_url=server.base_url, timeout=600.0) as http:
        started_s = time.monotonic()
        tasks = [asyncio.create_task(_stream(http, stream_body(settings, index),
                                             readers_done if index < settings.late_readers
                                             else None))
                 for index in range(settings.streams)]
        readers = tasks[settings.late_readers:]
        while not all(task.done() for task in readers):
            peak_mib = max(peak_mib, server_rss_mib())
            await asyncio.sleep(_SAMPLE_INTERVAL_S)
        readers_done.set()
        while not all(task.done() for task in tasks):
            peak_mib = max(peak_mib, server_rss_mib())
            await asyncio.sleep(_SAMPLE_INTERVAL_S)
        results = [task.result() for task in tasks]
        duration_s = time.monotonic() - started_s
    ended_mib = server_rss_mib()
    await asyncio.sleep(settings.settle_s)
    settled_mib = server_rss_mib()
    settled_bound_mib = start_mib * settings.max_settled_ratio
    figures: Figures = [
        ("streams: statuses", ", ".join(str(result.status) for result in results)),
        ("streams: tokens", ", ".join(str(result.num_tokens) for result in results)),
        ("streams: seconds", round(duration_s, 1)),
        ("API server RSS start / peak / streams ended, MiB",
         f"{start_mib:.0f} / {peak_mib:.0f} / {ended_mib:.0f}"),
        (f"API server RSS {settings.settle_s:g} s after the streams, MiB", round(settled_mib)),
    ]
    checks = [
        Check("every stream ended with [DONE] after its tokens",
              all(result.status == 200 and result.done and result.num_tokens == settings.tokens
                  for result in results), ""),
        Check(f"API server RSS {settings.settle_s:g} s later within "
              f"{settings.max_settled_ratio:g}x of its start", settled_mib <= settled_bound_mib,
              f"{settled_mib:.0f} MiB (bound {settled_bound_mib:.0f})"),
    ]
    return figures, checks


async def _stream(http: httpx.AsyncClient, body: dict[str, Any],
                  read_after: asyncio.Event | None) -> StreamResult:
    """Sends one streamed completion and reads it to its end; with `read_after`, reads
    nothing past the headers until that event is set."""
    num_tokens, done = 0, False
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return StreamResult(response.status_code, 0, False)
            if read_after is not None:
                await read_after.wait()
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    continue
                for choice in json.loads(data).get("choices", []):
                    logprobs = choice.get("logprobs") or {}
                    num_tokens += len(logprobs.get("tokens") or [])
            return StreamResult(response.status_code, num_tokens, done)
    except httpx.HTTPError as error:
        return StreamResult(type(error).__name__, num_tokens, False)
