"""`continuum serve` as a user runs it: a subprocess, then the README's SDK example."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[3]


def _readme_example() -> str:
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.DOTALL)
    (example,) = [block for block in blocks if "OpenAI(" in block]
    return example


class Served:
    """`continuum serve --port 0 FLAGS` in a subprocess; `url` once it serves."""

    def __init__(self, *flags: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "engine.cli", "serve", "--port", "0", "--log-level", "info",
             *flags],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        self.lines: list[str] = []
        self._found = threading.Event()
        self._url: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)
            match = re.search(r"serving tiny on (http://\S+)", line)
            if match:
                self._url.append(match.group(1))
                self._found.set()

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def wait_serving(self, timeout_s: float = 120.0) -> str:
        deadline_s = time.monotonic() + timeout_s
        while not self._found.wait(0.1):
            assert self.process.poll() is None, self.log
            assert time.monotonic() < deadline_s, self.log
        return self._url[0]

    def core_pid(self) -> int:
        """The engine core: the server's spawned child (not multiprocessing's resource
        tracker)."""
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        (pid,) = [int(word) for word in children.read_text().split()
                  if b"spawn_main" in Path(f"/proc/{word}/cmdline").read_bytes()]
        return pid

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def served():
    """`continuum serve --port 0`; yields its base URL; interrupted like Ctrl-C at the end."""
    server = Served("--num-kv-blocks", "512")
    try:
        url = server.wait_serving()
        yield url
        server.process.send_signal(signal.SIGINT)
        assert server.process.wait(30) == 0, server.log
    finally:
        server.kill()


def test_readme_example_against_continuum_serve(served, capsys):
    code = _readme_example().replace("http://127.0.0.1:8000", served)
    exec(compile(code, "README example", "exec"), {})
    printed = capsys.readouterr().out
    assert printed.strip().endswith("0")  # cached tokens of a first turn


def test_serve_refuses_a_bad_flag_value():
    result = subprocess.run(
        [sys.executable, "-m", "engine.cli", "serve", "--max-num-seqs", "0", "--port", "0"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "max_num_seqs" in result.stderr


def test_serve_binds_loopback_by_default(served):
    assert served.startswith("http://127.0.0.1:")


def test_serve_exits_when_its_engine_core_dies_mid_stream():
    """In-flight streams end with an engine_dead error event, new requests get 503 (or find
    the port closed), and the process exits with status 1 within seconds."""
    server = Served("--num-kv-blocks", "128", "--max-model-len", "2048")
    try:
        url = server.wait_serving()
        with httpx.Client(base_url=url, timeout=30) as http:
            body = {"model": "tiny", "prompt": "long", "max_tokens": 2000, "ignore_eos": True,
                    "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as response:
                lines = response.iter_lines()
                assert next(lines).startswith("data: {")
                os.kill(server.core_pid(), signal.SIGKILL)
                killed_s = time.monotonic()
                rest = list(lines)
            assert time.monotonic() - killed_s < 5
            assert any("engine_dead" in line for line in rest), rest
            assert rest[-1] == "data: [DONE]" or rest[-1] == ""
            try:
                response = http.get("/health")
                assert response.status_code == 503
            except httpx.TransportError:
                pass  # already gone
        assert server.process.wait(15) == 1, server.log
        assert "the engine core died" in server.log
    finally:
        server.kill()


def test_serve_refuses_a_bad_limit():
    result = subprocess.run(
        [sys.executable, "-m", "engine.cli", "serve", "--max-n", "0", "--port", "0"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "max_n" in result.stderr
