"""`continuum serve` as a real subprocess on a loopback port, for the benchmarks that start
their own server (`python -m lab load`, `soak`, `connections`, `amplification`, `drain`), and their
server flags (`--serve-args`, `--server-log`).

`ServerProcess` starts the server (`python -m engine.cli serve --port 0 ...`; a free port
with `--replicas`, whose proxy binds a fixed one), learns its address from the start-up log
line, waits for `/health`, and stops it on exit (SIGINT, then SIGTERM, then SIGKILL). It
reads the resident memory of the server and of its descendants (the engine core runs in a
spawned child) from `/proc`, and scrapes `/metrics`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import httpx

_ADDRESS = re.compile(r"serving \S+ on (http://\S+) ")
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")
_KIB_PER_MIB = 1024.0


@dataclass(frozen=True)
class ServerSpec:
    """How to start the server: `serve_args` are `continuum serve` flags (`--port` and
    `--host` are chosen here); `startup_timeout_s` bounds the wait for `/health`;
    `stop_timeout_s` bounds each stage of stopping it."""

    serve_args: tuple[str, ...] = ()
    startup_timeout_s: float = 180.0
    stop_timeout_s: float = 20.0

    def __post_init__(self) -> None:
        for flag in ("--port", "--host"):
            if any(arg == flag or arg.startswith(flag + "=") for arg in self.serve_args):
                raise ValueError(f"{flag} is chosen by ServerProcess (127.0.0.1, a free port)")
        if self.startup_timeout_s <= 0 or self.stop_timeout_s <= 0:
            raise ValueError("timeouts must be positive")


class ServerProcess:
    """A `continuum serve` subprocess, owned by this object from `start()` (or `with`) to
    `stop()`. Its stderr goes to `log_path` (a temporary file, removed at `stop()`, when
    none is given)."""

    def __init__(self, spec: ServerSpec, log_path: Path | None = None) -> None:
        self.spec = spec
        self._own_log = log_path is None
        self.log_path = log_path or Path(tempfile.mkstemp(prefix="continuum-serve-",
                                                          suffix=".log")[1])
        self._process: subprocess.Popen[bytes] | None = None
        self.base_url = ""

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        if self._process is None:
            raise RuntimeError("the server is not started")
        return self._process.pid

    def start(self) -> ServerProcess:
        """Starts the server and returns once `/health` answers 200; RuntimeError with the
        log's tail if it exits or does not become healthy within `startup_timeout_s`."""
        # Ray Serve's proxy binds a fixed port: replicas get one that is free now.
        port = free_port() if "--replicas" in self.spec.serve_args else 0
        command = [sys.executable, "-m", "engine.cli", "serve", "--host", "127.0.0.1",
                   "--port", str(port), *self.spec.serve_args]
        with self.log_path.open("wb") as log:
            self._process = subprocess.Popen(command, stdin=subprocess.DEVNULL,
                                             stdout=log, stderr=subprocess.STDOUT)
        deadline_s = time.monotonic() + self.spec.startup_timeout_s
        try:
            self.base_url = self._wait_for_address(deadline_s)
            self._wait_healthy(deadline_s)
        except RuntimeError:
            self.stop()
            raise
        return self

    def _wait_for_address(self, deadline_s: float) -> str:
        while True:
            match = _ADDRESS.search(self.log_text())
            if match:
                return match.group(1)
            self._check_running_until(deadline_s, "did not log its address")
            time.sleep(0.1)

    def _wait_healthy(self, deadline_s: float) -> None:
        while not self.is_healthy():
            self._check_running_until(deadline_s, "did not become healthy")
            time.sleep(0.1)

    def _check_running_until(self, deadline_s: float, what: str) -> None:
        if not self.is_running():
            raise RuntimeError(f"the server exited ({self.returncode}):\n{self.log_tail()}")
        if time.monotonic() > deadline_s:
            raise RuntimeError(f"the server {what} within {self.spec.startup_timeout_s} s:\n"
                               f"{self.log_tail()}")

    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self._process is None else self._process.poll()

    def is_healthy(self) -> bool:
        """`/health` answers 200 (False while starting, once the core died, or if gone)."""
        if not self.base_url:
            return False
        try:
            return httpx.get(self.base_url + "/health", timeout=10.0).status_code == 200
        except httpx.HTTPError:
            return False

    def metrics(self) -> dict[str, float]:
        """The samples of `/metrics`, by metric name, summed over label sets."""
        response = httpx.get(self.base_url + "/metrics", timeout=30.0)
        response.raise_for_status()
        return parse_prometheus(response.text)

    def process_ids(self) -> list[int]:
        """The server's pid and those of its live descendants (the engine core)."""
        return [self.pid, *descendant_pids(self.pid)]

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) the server listens on."""
        url = httpx.URL(self.base_url)
        if url.host is None or url.port is None:
            raise RuntimeError(f"the server's address is not known yet ({self.base_url!r})")
        return url.host, url.port

    def num_fds(self) -> int:
        """Descriptors the server process holds open (0 once it is gone)."""
        try:
            return len(os.listdir(f"/proc/{self.pid}/fd"))
        except FileNotFoundError:
            return 0

    def rss_mib(self) -> float:
        """Resident memory of the server and its descendants, MiB (a process that ends
        while being read counts 0)."""
        return sum(read_rss_mib(pid) or 0.0 for pid in self.process_ids())

    def cpu_s(self) -> tuple[float, float] | None:
        """User and system CPU seconds the server's own process has used so far (not its
        descendants: the engine core, the body-parsing children); None once it is gone."""
        return read_cpu_s(self.pid)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, num_lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-num_lines:])

    def signal_and_wait(self, signum: int, timeout_s: float) -> int | None:
        """Sends the server `signum` and waits up to `timeout_s` for it to exit; its exit
        status, None if it still runs."""
        if self._process is None:
            raise RuntimeError("the server is not started")
        self._process.send_signal(signum)
        try:
            return self._process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> int | None:
        """Stops the server (SIGINT for a clean shutdown, then SIGTERM, then SIGKILL) and
        any descendant left behind; the exit status. Idempotent."""
        process = self._process
        if process is None:
            return None
        leftovers = descendant_pids(process.pid) if process.poll() is None else []
        for stage in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
            if process.poll() is not None:
                break
            process.send_signal(stage)
            try:
                process.wait(self.spec.stop_timeout_s)
            except subprocess.TimeoutExpired:
                continue
        _kill_survivors(leftovers, self.spec.stop_timeout_s)
        if self._own_log:
            self.log_path.unlink(missing_ok=True)
        return process.returncode


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def add_server_arguments(parser: argparse.ArgumentParser, default_args: Sequence[str]) -> None:
    """`--serve-args` and `--server-log`, the server flags of the commands that start one."""
    parser.add_argument("--serve-args", default=shlex.join(default_args),
                        help="flags of the `continuum serve` subprocess, replacing the "
                             "defaults (default: %(default)r)")
    parser.add_argument("--server-log", default=None,
                        help="keep the server's log here (default: a temporary file)")


def server_from_args(args: argparse.Namespace, *, check_invariants: bool) -> ServerProcess:
    """The server, not started yet, that the `add_server_arguments` flags describe: its
    `--serve-args` (with `--debug-check-invariants` added if `check_invariants`), its log at
    `--server-log` if given. ValueError if the flags name the host or port."""
    serve_args = shlex.split(args.serve_args)
    if check_invariants and "--debug-check-invariants" not in serve_args:
        serve_args.append("--debug-check-invariants")
    log_path = None if args.server_log is None else Path(args.server_log)
    return ServerProcess(ServerSpec(serve_args=tuple(serve_args)), log_path)


def _kill_survivors(pids: Sequence[int], timeout_s: float) -> None:
    """The core stops by itself once its frontend is gone; SIGKILL for one that did not."""
    deadline_s = time.monotonic() + timeout_s
    alive = list(pids)
    while alive and time.monotonic() < deadline_s:
        alive = [pid for pid in alive if read_rss_mib(pid) is not None]
        time.sleep(0.1)
    for pid in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def read_cpu_s(pid: int, proc_root: Path = Path("/proc")) -> tuple[float, float] | None:
    """User and system CPU seconds of process `pid` (its threads, not its children); None
    if the process is gone."""
    try:
        stat = (proc_root / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The fields after the command name, which is in parentheses and may hold spaces: utime
    # and stime are the 14th and 15th of the whole line.
    fields = stat.rsplit(")", 1)[1].split()
    ticks_per_s = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / ticks_per_s, int(fields[12]) / ticks_per_s


def read_rss_mib(pid: int, proc_root: Path = Path("/proc")) -> float | None:
    """`VmRSS` of process `pid`, MiB; None if the process is gone (or a zombie, which has
    no memory)."""
    try:
        status = (proc_root / str(pid) / "status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            kib = int(line.split()[1])
            return kib / _KIB_PER_MIB
    return None


def descendant_pids(pid: int, proc_root: Path = Path("/proc")) -> list[int]:
    """The pids of the live descendants of `pid`, parents before children."""
    children: dict[int, list[int]] = {}
    for child, parent in _parent_pids(proc_root):
        children.setdefault(parent, []).append(child)
    found: list[int] = []
    frontier = [pid]
    while frontier:
        kids = sorted(children.get(frontier.pop(0), []))
        found.extend(kids)
        frontier.extend(kids)
    return found


def _parent_pids(proc_root: Path) -> Iterator[tuple[int, int]]:
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        # The command name, in parentheses, may itself hold spaces and parentheses.
        fields = stat.rpartition(")")[2].split()
        if len(fields) >= 2:
            yield int(entry.name), int(fields[1])


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {metric name: value summed over its label sets}.
    Comments and unparsable lines are skipped."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        match = _SAMPLE.match(line.strip())
        if match is None:
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        samples[match.group(1)] = samples.get(match.group(1), 0.0) + value
    return samples
