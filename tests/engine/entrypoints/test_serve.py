"""`continuum serve` as a user runs it: a subprocess, then the README's SDK example."""

from __future__ import annotations

import contextlib
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

from engine.cli import build_parser
from lab.server_process import ServerProcess, ServerSpec, descendant_pids
from tests.engine.model.real_model import REAL_MODEL, require_real_model

REPO = Path(__file__).resolve().parents[3]


def _readme_example() -> str:
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.DOTALL)
    (example,) = [block for block in blocks if "OpenAI(" in block]
    return example


def _core_pid(server: ServerProcess) -> int:
    """The engine core: the server's spawned child (not multiprocessing's resource tracker)."""
    (pid,) = [pid for pid in descendant_pids(server.pid)
              if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    return pid


@pytest.fixture
def served():
    """`continuum serve` of the README's model on a free port; yields its base URL;
    interrupted like Ctrl-C at the end, which must exit cleanly. A 512-token step budget keeps
    the start-up prefill profile short on a CPU."""
    require_real_model()
    server = ServerProcess(ServerSpec(serve_args=(
        "--model", REAL_MODEL, "--num-kv-blocks", "512", "--max-num-batched-tokens", "512",
    ))).start()
    try:
        yield server.base_url
    finally:
        log = server.log_text()
        assert server.stop() == 0, log


def test_readme_example_against_continuum_serve(served, capsys):
    code = _readme_example().replace("http://127.0.0.1:8000", served)
    exec(compile(code, "README example", "exec"), {})
    arguments, answer = capsys.readouterr().out.strip().splitlines()
    assert arguments == '{"city": "Paris"}'
    text, cached_tokens = answer.rsplit(" ", 1)
    assert "Paris" in text and "21" in text  # the tool's result reached the answer
    assert int(cached_tokens) >= 16  # the first turn's prompt blocks


def test_serve_refuses_a_bad_flag_value():
    result = subprocess.run(
        [sys.executable, "-m", "engine.cli", "serve", "--max-num-seqs", "0", "--port", "0"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "max_num_seqs" in result.stderr


@pytest.mark.parametrize(("flags", "named"), [
    # Bounded in the config classes: refused before the engine core starts.
    (["--max-num-seqs", str(2**63 - 1)], "max_num_seqs"),
    (["--num-kv-blocks", str(2**63 - 1)], "num_kv_blocks"),
    (["--cpu-kv-cache-space-gib", "1e30"], "cpu_kv_cache_space_gib"),
    (["--max-model-len", "100000000000"], "max_model_len"),
    (["--trace-path", "/"], "trace_path"),
    # Refused by the engine core as it starts: still a clean exit.
    (["--max-model-len", "8192"], "max_position_embeddings"),
])
def test_serve_refuses_a_hostile_setting_without_a_traceback(flags, named):
    result = subprocess.run(
        [sys.executable, "-m", "engine.cli", "serve", *flags, "--port", "0"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "cannot start" in result.stderr and named in result.stderr
    assert "Traceback" not in result.stderr


def test_serve_refuses_a_state_file_it_did_not_write(tmp_path):
    config = tmp_path / "serve.toml"
    config.write_text("[server]\napi_key = ['secret']\n")
    result = subprocess.run(
        [sys.executable, "-m", "engine.cli", "serve", "--policy-option",
         f"estimator_state={config}", "--port", "0"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2 and "estimator_state" in result.stderr, result.stderr
    assert config.read_text() == "[server]\napi_key = ['secret']\n"


def test_serve_binds_loopback_by_default():
    args = build_parser(["serve"]).parse_args(["serve"])
    assert (args.host, args.port) == ("127.0.0.1", 8000)


def test_serve_exits_when_its_engine_core_dies_mid_stream():
    """In-flight streams end with an engine_dead error event, new requests get 503 (or find
    the port closed), and the process exits with status 1 within seconds."""
    server = ServerProcess(ServerSpec(serve_args=("--num-kv-blocks", "128",
                                                  "--max-model-len", "2048"))).start()
    try:
        with httpx.Client(base_url=server.base_url, timeout=30) as http:
            body = {"model": "tiny", "prompt": "long", "max_tokens": 2000, "ignore_eos": True,
                    "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as response:
                lines = response.iter_lines()
                assert next(lines).startswith("data: {")
                os.kill(_core_pid(server), signal.SIGKILL)
                killed_s = time.monotonic()
                rest = list(lines)
            assert time.monotonic() - killed_s < 5
            assert any("engine_dead" in line for line in rest), rest
            assert rest[-1] == "data: [DONE]" or rest[-1] == ""
            with contextlib.suppress(httpx.TransportError):  # the server may be gone already
                assert http.get("/health").status_code == 503
        deadline_s = time.monotonic() + 15
        while server.is_running():
            assert time.monotonic() < deadline_s, server.log_text()
            time.sleep(0.1)
        assert server.returncode == 1
        assert "the engine core died" in server.log_text()
    finally:
        server.stop()


def test_serve_refuses_a_bad_limit():
    result = subprocess.run(
        [sys.executable, "-m", "engine.cli", "serve", "--max-n", "0", "--port", "0"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "max_n" in result.stderr


def _read_stream(server: ServerProcess, max_tokens: int, lines: list[str],
                 started: threading.Event) -> None:
    body = {"model": "tiny", "prompt": "drain", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=60) as http, \
            http.stream("POST", "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            lines.append(line)
            started.set()


def test_sigterm_drains_then_ends_the_streams_left_and_exits_0(tmp_path):
    """A stream that can finish within --shutdown-timeout-s does; one that cannot ends with
    a server_shutting_down error event and [DONE]; new connections are refused; exit 0.
    Simulated 70B steps (the executor a --config file sets) make the streams last."""
    config = tmp_path / "simulated.toml"
    config.write_text('executor = "simulated"\nsim_profile = "4xh100-llama3.1-70b"\n'
                      "shutdown_timeout_s = 30.0\n")
    server = ServerProcess(ServerSpec(serve_args=(
        "--shutdown-timeout-s", "2", "--config", str(config), "--max-model-len", "4096"))).start()
    try:
        streams = {"short": 20, "long": 3000}
        lines: dict[str, list[str]] = {name: [] for name in streams}
        started = {name: threading.Event() for name in streams}
        threads = [threading.Thread(target=_read_stream, daemon=True,
                                    args=(server, max_tokens, lines[name], started[name]))
                   for name, max_tokens in streams.items()]
        for thread in threads:
            thread.start()
        assert all(event.wait(60) for event in started.values())
        os.kill(server.pid, signal.SIGTERM)
        signalled_s = time.monotonic()
        for thread in threads:
            thread.join(30)
        events = {name: [line for line in found if line] for name, found in lines.items()}
        assert events["short"][-1] == "data: [DONE]"
        assert '"finish_reason":"length"' in events["short"][-2]
        assert events["long"][-1] == "data: [DONE]"
        assert "server_shutting_down" in events["long"][-2], events["long"][-3:]
        with pytest.raises(httpx.TransportError):
            httpx.get(server.base_url + "/health", timeout=5)
        deadline_s = signalled_s + 30
        while server.is_running():
            assert time.monotonic() < deadline_s, server.log_text()
            time.sleep(0.1)
        assert time.monotonic() - signalled_s > 1.5  # the long stream had its 2 s
        assert server.returncode == 0, server.log_tail()
    finally:
        server.stop()


def test_the_response_store_limit_is_a_serve_flag():
    """`--max-stored-responses 1`: storing a second response evicts the first."""
    server = ServerProcess(ServerSpec(serve_args=(
        "--num-kv-blocks", "64", "--max-model-len", "512", "--max-stored-responses", "1",
    ))).start()
    try:
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            ids = [http.post("/v1/responses", json={
                "model": "tiny", "input": f"turn {index}", "max_output_tokens": 2,
            }).json()["id"] for index in range(2)]
            assert http.get(f"/v1/responses/{ids[0]}").status_code == 404
            assert http.get(f"/v1/responses/{ids[1]}").status_code == 200
    finally:
        server.stop()
