"""`python -m lab ingress`: clients without an API key sending large bodies to a `continuum
serve --api-key KEY` subprocess (by default `--replicas 2`: Ray Serve's ingress), against the
memory of the server's processes.

`--clients` clients, at once, each send `--bodies` `POST /v1/completions` one after another,
with no Authorization header and a JSON body of `--body-mib` MiB (keep it under the server's
`--max-request-body-bytes`, 16 MiB by default, so that a server which reads bodies first reads
it all). Each client writes its body in 64 KiB chunks over a raw socket and stops writing as
soon as an answer arrives, so an answer given before the body was read counts as early. The
summed RSS of the server and every descendant (with `--replicas`, Ray's GCS, raylet, proxy,
ingress and replicas) is sampled every 0.2 s. Afterwards one completion with the key must be
answered 200.

Figures: RSS before the attack, its peak and after (MiB), the peak's growth, the answers by
status, the median and worst seconds from a request's start to its answer, and the bytes of
body the clients wrote. Checks: every request got 401, and the completion with the key got
200. RSS counts each process's resident pages, shared ones (Ray's object store) in every
process that touched them, so it overstates a total; it is compared between runs of this
command only.
"""

from __future__ import annotations

import argparse
import contextlib
import select
import shlex
import socket
import statistics
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from lab.flags import add_settings_flags, bench_setting, parse_serve_args, settings_from_args
from lab.server_checks import Check, checks_to_dicts, passed, run_against_server
from lab.server_process import ServerProcess, add_server_arguments

API_KEY = "ingress-bench-key"
DEFAULT_SERVE_ARGS = ("--model", "tiny", "--max-model-len", "2048", "--replicas", "2",
                      "--api-key", API_KEY)
CHUNK_BYTES = 64 * 1024
SAMPLE_INTERVAL_S = 0.2


@dataclass
class Answer:
    """One request: the status line's code (None: none came), seconds to it, bytes written."""

    status: int | None = None
    seconds: float | None = None
    bytes_sent: int = 0


@dataclass
class IngressReport:
    """The run's figures and checks (see the module docstring)."""

    rss_before_mib: float
    rss_peak_mib: float
    rss_after_mib: float
    answers: list[Answer]
    authorized_status: int | None
    checks: tuple[Check, ...] = field(default=())

    @property
    def passed(self) -> bool:
        return passed(self.checks)

    def figures(self) -> list[tuple[str, object]]:
        statuses = Counter("no answer" if a.status is None else str(a.status)
                           for a in self.answers)
        seconds = [a.seconds for a in self.answers if a.seconds is not None]
        return [
            ("requests without a key", len(self.answers)),
            ("answers by status", ", ".join(f"{k} {v}" for k, v in sorted(statuses.items()))),
            ("seconds to an answer, median / worst",
             f"{statistics.median(seconds):.2f} / {max(seconds):.2f}" if seconds else "-"),
            ("body bytes written (MiB)", round(sum(a.bytes_sent for a in self.answers) / 2**20)),
            ("server RSS before / peak / after (MiB)",
             f"{self.rss_before_mib:.0f} / {self.rss_peak_mib:.0f} / {self.rss_after_mib:.0f}"),
            ("peak growth (MiB)", round(self.rss_peak_mib - self.rss_before_mib)),
            ("completion with the key", self.authorized_status),
        ]

    def to_dict(self) -> dict[str, Any]:
        return {"figures": dict(self.figures()), "checks": checks_to_dicts(self.checks)}


@dataclass(frozen=True)
class IngressSettings:
    """The clients and the bodies each sends without a key."""

    clients: int = bench_setting(16, "clients sending at once")
    bodies: int = bench_setting(2, "requests each client sends, one after another")
    body_mib: float = bench_setting(15.0, "MiB of each body")

    def __post_init__(self) -> None:
        if self.clients < 1 or self.bodies < 1 or self.body_mib <= 0:
            raise ValueError("--clients and --bodies must be >= 1, --body-mib > 0")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_flags(parser, IngressSettings)
    parser.add_argument("--json", default=None, help="write the figures here")
    add_server_arguments(parser, DEFAULT_SERVE_ARGS)


def main(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(IngressSettings, args)
        keys = parse_serve_args(shlex.split(args.serve_args)).api_key
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if not keys:
        print("error: --serve-args must give the server an --api-key", file=sys.stderr)
        return 2
    return run_against_server(
        args, lambda server: run_ingress(server, settings, keys[-1]), check_invariants=False,
        context=asdict(settings))


def run_ingress(server: ServerProcess, settings: IngressSettings,
                api_key: str) -> IngressReport:
    """The attack, with the server's RSS sampled throughout; then a completion with the key."""
    rss_before = server.rss_mib()
    peak = [rss_before]
    done = threading.Event()
    sampler = threading.Thread(target=_sample_rss, args=(server, peak, done), daemon=True)
    sampler.start()
    body = _body(int(settings.body_mib * 2**20))
    answers = [[Answer() for _ in range(settings.bodies)] for _ in range(settings.clients)]
    clients = [threading.Thread(target=_send_all, args=(server.address, body, own))
               for own in answers]
    for client in clients:
        client.start()
    for client in clients:
        client.join()
    time.sleep(1.0)  # what the server still held when the last answer came
    done.set()
    sampler.join()
    rss_after = server.rss_mib()
    authorized = _authorized_completion(server.base_url, api_key)
    report = IngressReport(rss_before, max(peak), rss_after,
                           [answer for own in answers for answer in own], authorized)
    report.checks = _checks(report)
    return report


def _body(num_bytes: int) -> bytes:
    head, tail = b'{"model": "tiny", "max_tokens": 1, "prompt": "', b'"}'
    return head + b"a" * max(0, num_bytes - len(head) - len(tail)) + tail


def _sample_rss(server: ServerProcess, peak: list[float], done: threading.Event) -> None:
    while not done.wait(SAMPLE_INTERVAL_S):
        peak.append(server.rss_mib())


def _send_all(address: tuple[str, int], body: bytes, answers: list[Answer]) -> None:
    for answer in answers:
        _send(address, body, answer)


def _send(address: tuple[str, int], body: bytes, answer: Answer) -> None:
    """One request without a key over a raw socket: writes the body until an answer comes."""
    started = time.monotonic()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {address[0]}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode()
    status_line = b""
    with contextlib.suppress(OSError), socket.create_connection(address, timeout=120) as sock:
        with contextlib.suppress(OSError):  # a server that answered may close on the body
            sock.sendall(head)
            view = memoryview(body)
            while answer.bytes_sent < len(body):
                if select.select([sock], [], [], 0)[0]:
                    break  # answered before the whole body was read
                answer.bytes_sent += sock.send(view[answer.bytes_sent:
                                                    answer.bytes_sent + CHUNK_BYTES])
        status_line = _read_status_line(sock)
    answer.seconds = time.monotonic() - started
    parts = status_line.split()
    if len(parts) >= 2 and parts[1].isdigit():
        answer.status = int(parts[1])


def _read_status_line(sock: socket.socket) -> bytes:
    """The answer's first line (what arrived of it before the connection ended)."""
    data = b""
    with contextlib.suppress(OSError):
        while b"\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    return data.split(b"\r\n", 1)[0]


def _authorized_completion(base_url: str, api_key: str) -> int | None:
    try:
        return httpx.post(base_url + "/v1/completions", timeout=120,
                          headers={"Authorization": f"Bearer {api_key}"},
                          json={"model": "tiny", "prompt": "hi", "max_tokens": 2}).status_code
    except httpx.HTTPError:
        return None


def _checks(report: IngressReport) -> tuple[Check, ...]:
    refused = sum(answer.status == 401 for answer in report.answers)
    return (
        Check("every request without a key got 401", refused == len(report.answers),
              f"{refused} of {len(report.answers)}"),
        Check("a completion with the key got 200", report.authorized_status == 200,
              str(report.authorized_status)),
    )
