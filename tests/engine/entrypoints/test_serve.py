"""`continuum serve` as a user runs it: a subprocess, then the README's SDK example."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def _readme_example() -> str:
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.DOTALL)
    (example,) = [block for block in blocks if "OpenAI(" in block]
    return example


@pytest.fixture
def served():
    """`continuum serve --port 0`; yields its base URL; interrupted like Ctrl-C at the end."""
    process = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "serve", "--port", "0", "--num-kv-blocks", "512",
         "--log-level", "info"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines: list[str] = []
    found = threading.Event()
    url: list[str] = []

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            match = re.search(r"serving tiny on (http://\S+)", line)
            if match:
                url.append(match.group(1))
                found.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline_s = time.monotonic() + 120
        while not found.wait(0.1):
            assert process.poll() is None, "".join(lines)
            assert time.monotonic() < deadline_s, "".join(lines)
        yield url[0]
        process.send_signal(signal.SIGINT)
        assert process.wait(30) == 0, "".join(lines)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


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
