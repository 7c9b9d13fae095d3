"""Slow and many clients against a real `continuum serve`: silent and trickling connections
are closed after the header timeout, a stalled body gets 408, connections beyond the cap get
503 and hold no descriptor; meanwhile `/health` answers and the engine leaks nothing. Also
the rate-limited log filter, with an injected clock, and the protocol's view of a client
that closed its side."""

from __future__ import annotations

import errno
import json
import logging
import selectors
import socket
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest

from engine.entrypoints.connections import (
    ConnectionSettings,
    GuardedH11Protocol,
    RateLimitFilter,
    error_response_bytes,
    fit_to_open_file_limit,
    is_resource_exhaustion,
)
from lab.bench.connections import SILENT, TRICKLING, SlowClientSettings, run_slow_clients
from lab.server_checks import markdown_figures, wait_idle
from lab.server_process import ServerProcess, ServerSpec

HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 230
NUM_SILENT = 200
# A busy 2-core machine may answer late; the timeouts must still be seen to work.
SLACK_S = 4.0


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    spec = ServerSpec(serve_args=(
        "--num-kv-blocks", "256", "--max-model-len", "1024", "--debug-check-invariants",
        "--header-timeout-s", str(HEADER_TIMEOUT_S), "--body-timeout-s", str(BODY_TIMEOUT_S),
        "--max-connections", str(MAX_CONNECTIONS), "--no-job-inference"))  # see the bench
    process = ServerProcess(spec).start()
    try:
        yield process
    finally:
        log = process.log_text()
        assert process.stop() == 0, log


def _wait_for_fds(server: ServerProcess, expected: int, timeout_s: float = 5.0) -> int:
    """The server's descriptor count once it is at most `expected` (or the last seen)."""
    deadline_s = time.monotonic() + timeout_s
    while (count := server.num_fds()) > expected and time.monotonic() < deadline_s:
        time.sleep(0.05)
    return count


def _settled_fds(server: ServerProcess, still_s: float = 0.3, timeout_s: float = 5.0) -> int:
    """The server's descriptor count once it stopped changing for `still_s` (connections
    that clients just closed take the server a moment to close)."""
    count, since_s = server.num_fds(), time.monotonic()
    deadline_s = since_s + timeout_s
    while time.monotonic() - since_s < still_s and time.monotonic() < deadline_s:
        time.sleep(0.05)
        if (now := server.num_fds()) != count:
            count, since_s = now, time.monotonic()
    return count


def _read_to_close(sock: socket.socket, timeout_s: float) -> bytes:
    """Everything the server sends until it closes the connection; TimeoutError if it stays
    open `timeout_s`."""
    sock.settimeout(timeout_s)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def _json_body(response: bytes) -> dict[str, object]:
    head, _, body = response.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), head
    assert b"connection: close" in head.lower(), head
    return json.loads(body)


class _HealthProbe:
    """Polls `/health` on fresh connections from a thread every `interval_s`, keeping each
    latency (s) and each failure."""

    def __init__(self, base_url: str, interval_s: float = 0.1) -> None:
        self.base_url = base_url
        self.interval_s = interval_s
        self.latencies_s: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            started_s = time.monotonic()
            try:
                status = httpx.get(self.base_url + "/health", timeout=10.0).status_code
                if status != 200:
                    self.failures.append(f"status {status}")
            except httpx.HTTPError as error:
                self.failures.append(repr(error))
            self.latencies_s.append(time.monotonic() - started_s)
            self._stop.wait(self.interval_s)


def test_silent_connections_are_closed_after_the_header_timeout(server: ServerProcess):
    baseline_fds = _settled_fds(server)
    address = server.address
    with _HealthProbe(server.base_url) as probe:
        opened_s: dict[socket.socket, float] = {}
        for _ in range(NUM_SILENT):
            sock = socket.create_connection(address)
            opened_s[sock] = time.monotonic()
        received = {sock: b"" for sock in opened_s}
        lifetimes_s: list[float] = []
        deadline_s = time.monotonic() + HEADER_TIMEOUT_S + SLACK_S
        with selectors.DefaultSelector() as selector:
            for sock in opened_s:
                selector.register(sock, selectors.EVENT_READ)
            while selector.get_map() and time.monotonic() < deadline_s:
                for key, _ in selector.select(timeout=0.1):
                    sock = key.fileobj
                    chunk = sock.recv(65536)
                    received[sock] += chunk
                    if not chunk:
                        lifetimes_s.append(time.monotonic() - opened_s[sock])
                        selector.unregister(sock)
            still_open = len(selector.get_map())
        for sock in opened_s:
            sock.close()
    assert still_open == 0
    assert min(lifetimes_s) >= HEADER_TIMEOUT_S * 0.9
    assert max(lifetimes_s) <= HEADER_TIMEOUT_S + SLACK_S
    for data in received.values():
        assert data.startswith(b"HTTP/1.1 408 "), data
        assert _json_body(data)["error"]["code"] == "request_timeout"
    assert not probe.failures
    assert len(probe.latencies_s) >= 5
    assert max(probe.latencies_s) < 1.0, sorted(probe.latencies_s)[-5:]
    assert _wait_for_fds(server, baseline_fds) <= baseline_fds


def _trickle(sock: socket.socket, data: bytes, interval_s: float, timeout_s: float) -> float:
    """Sends `data` one byte per `interval_s` until the server closes the connection (or all
    was sent); how long that took from the first byte, s."""
    started_s = time.monotonic()
    sock.settimeout(interval_s)
    for byte in data:
        try:
            sock.sendall(bytes([byte]))
            if not sock.recv(65536, socket.MSG_PEEK):
                return time.monotonic() - started_s
        except TimeoutError:
            continue
        except (BrokenPipeError, ConnectionResetError):
            return time.monotonic() - started_s
        assert _read_to_close(sock, timeout_s).startswith(b"HTTP/1.1 408 ")
        return time.monotonic() - started_s
    raise AssertionError(f"the server read {len(data)} bytes over {timeout_s} s")


def test_a_trickling_request_line_is_cut_off_after_the_header_timeout(server: ServerProcess):
    request = b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Slow: " + b"a" * 100
    with socket.create_connection(server.address) as sock:
        elapsed_s = _trickle(sock, request, 0.3, HEADER_TIMEOUT_S + SLACK_S)
    assert HEADER_TIMEOUT_S * 0.9 <= elapsed_s <= HEADER_TIMEOUT_S + SLACK_S


def test_a_keep_alive_connection_trickling_its_next_request_is_cut_off(server: ServerProcess):
    with socket.create_connection(server.address) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        sock.settimeout(10.0)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        time.sleep(HEADER_TIMEOUT_S * 1.2)  # idle longer than the header timeout: kept alive
        request = b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Slow: " + b"a" * 100
        elapsed_s = _trickle(sock, request, 0.3, HEADER_TIMEOUT_S + SLACK_S)
    assert HEADER_TIMEOUT_S * 0.9 <= elapsed_s <= HEADER_TIMEOUT_S + SLACK_S


def test_a_stalled_body_gets_408(server: ServerProcess):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n")
    with socket.create_connection(server.address) as sock:
        sock.sendall(head + b'{"model": ')
        started_s = time.monotonic()
        response = _read_to_close(sock, BODY_TIMEOUT_S + SLACK_S)
        elapsed_s = time.monotonic() - started_s
    assert response.startswith(b"HTTP/1.1 408 "), response
    error = _json_body(response)["error"]
    assert error["code"] == "request_timeout" and "body" in error["message"]
    assert BODY_TIMEOUT_S * 0.9 <= elapsed_s <= BODY_TIMEOUT_S + SLACK_S


def test_a_stream_outlasting_the_timeouts_is_not_cut(server: ServerProcess):
    """The body timer stops once the body is in: the stream's wait for a disconnect runs on."""
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 20, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=60.0) as http, \
            http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(lines).startswith("data: {")
        time.sleep(max(HEADER_TIMEOUT_S, BODY_TIMEOUT_S) * 1.5)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    assert len(rest) >= 2


def _keep_alive_connection(address: tuple[str, int]) -> socket.socket:
    """A connection that made one request and now idles (kept alive, past the header timer)."""
    sock = socket.create_connection(address)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
    sock.settimeout(10.0)
    assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
    return sock


def _busy_connection(address: tuple[str, int]) -> socket.socket:
    """A connection in the middle of a request (its headers read by the server, which asks
    for the body with `100 Continue`; its body not yet in): not evictable, until the body
    timeout."""
    sock = socket.create_connection(address)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                 b"Content-Type: application/json\r\nContent-Length: 100\r\n"
                 b"Expect: 100-continue\r\n\r\n")
    sock.settimeout(SLACK_S)
    assert sock.recv(65536).startswith(b"HTTP/1.1 100 "), "the server did not read the headers"
    sock.sendall(b"{")
    return sock


def test_connections_beyond_the_cap_get_503_and_hold_no_descriptor(server: ServerProcess):
    """While every connection is busy with a request, one more gets 503 (within the body
    timeout that frees the busy ones)."""
    address = server.address
    baseline_fds = _settled_fds(server)
    held = [_busy_connection(address) for _ in range(MAX_CONNECTIONS)]
    try:
        deadline_s = time.monotonic() + SLACK_S
        while (full_fds := server.num_fds()) < baseline_fds + MAX_CONNECTIONS:
            assert time.monotonic() < deadline_s, full_fds  # all accepted
            time.sleep(0.02)
        for _ in range(10):
            with socket.create_connection(address) as sock:
                response = _read_to_close(sock, 5.0)
            assert response.startswith(b"HTTP/1.1 503 "), response
            assert _json_body(response)["error"]["code"] == "too_many_connections"
        assert server.num_fds() <= full_fds
    finally:
        for sock in held:
            sock.close()
    assert _wait_for_fds(server, baseline_fds) <= baseline_fds
    assert httpx.get(server.base_url + "/health", timeout=10.0).status_code == 200
    # Ten refusals within seconds are one log line (the others are counted, not written).
    assert server.log_text().count("refused a connection") == 1


def test_silent_connections_filling_the_cap_give_way_to_new_clients(server: ServerProcess):
    """A slowloris that fills the cap does not lock others out: each new connection takes
    the place of the oldest one still waiting for its headers, which gets 408."""
    address = server.address
    silent = [socket.create_connection(address) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)  # every silent connection is accepted
        for _ in range(3):  # each on a fresh connection
            assert httpx.get(server.base_url + "/health", timeout=10.0).status_code == 200
        evicted = _read_to_close(silent[0], 5.0)
        assert evicted.startswith(b"HTTP/1.1 408 "), evicted
        assert _json_body(evicted)["error"]["code"] == "request_timeout"
    finally:
        for sock in silent:
            sock.close()


def test_idle_keep_alive_connections_filling_the_cap_give_way_too(server: ServerProcess):
    address = server.address
    idle = [_keep_alive_connection(address) for _ in range(MAX_CONNECTIONS)]
    try:
        assert httpx.get(server.base_url + "/health", timeout=10.0).status_code == 200
        assert _read_to_close(idle[0], 5.0) == b""  # closed between requests, no answer
    finally:
        for sock in idle:
            sock.close()


def test_the_connections_bench_runs_reduced(server: ServerProcess):
    settings = SlowClientSettings(num_silent=20, num_trickling=5, trickle_interval_s=0.2,
                                  wait_s=HEADER_TIMEOUT_S + SLACK_S, max_tokens=2)
    report = run_slow_clients(server, settings)
    assert report.passed, markdown_figures(report.figures(), report.checks)
    assert {(o.kind, o.status) for o in report.outcomes} == {(SILENT, 408), (TRICKLING, 408)}
    assert report.kept_health.latencies_s and report.completions.latencies_s


def test_the_engine_serves_and_leaks_nothing_afterwards(server: ServerProcess):
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 8, "ignore_eos": True}
    response = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60.0)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 8
    state = wait_idle(server, timeout_s=30.0)
    assert state is not None and state.idle and state.leaked_blocks == 0
    assert server.metrics()["continuum:invariant_checks_total"] > 0
    assert "Too many open files" not in server.log_text()


# Units: settings, the raw error response, the log filter.


def test_settings_refuse_non_positive_limits():
    for bad in ({"header_timeout_s": 0}, {"body_timeout_s": -1}, {"max_connections": 0}):
        with pytest.raises(ValueError):
            ConnectionSettings(**bad)


def test_the_cap_is_fitted_to_the_open_file_limit():
    settings = ConnectionSettings(max_connections=1024)
    assert fit_to_open_file_limit(settings, 65536) == settings
    assert fit_to_open_file_limit(settings, 1024).max_connections < 1024


def test_error_response_bytes_is_a_complete_openai_error():
    data = error_response_bytes(503, "full", "too_many_connections", [(b"server", b"x")])
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0] == b"HTTP/1.1 503 Service Unavailable"
    assert f"content-length: {len(body)}".encode() in head
    assert json.loads(body) == {"error": {"message": "full", "type": "server_error",
                                          "param": None, "code": "too_many_connections"}}


class _Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def _record(message: str, *args: object, name: str = "asyncio",
            error: BaseException | None = None) -> logging.LogRecord:
    exc_info = None if error is None else (type(error), error, None)
    return logging.LogRecord(name, logging.ERROR, __file__, 1, message, args, exc_info)


def test_the_log_filter_lets_one_message_per_interval_through_with_a_count():
    clock = _Clock()
    limit = RateLimitFilter(10.0, applies_to=is_resource_exhaustion, clock=clock)
    exhausted = OSError(errno.EMFILE, "Too many open files")
    accept_failure = "socket.accept() out of system resource\nsocket: <%s>"
    assert limit.filter(_record(accept_failure, "fd=5", error=exhausted))
    for step in range(1, 100):
        clock.now_s = step * 0.05
        assert not limit.filter(_record(accept_failure, "fd=5", error=exhausted))
    clock.now_s = 10.0
    passed = _record(accept_failure, "fd=5", error=exhausted)
    assert limit.filter(passed)
    assert passed.getMessage().endswith("[99 more like this suppressed in the last 10 s]")
    assert passed.exc_info is not None  # the traceback is still logged, once
    clock.now_s = 25.0  # nothing suppressed since: the message is unchanged
    quiet = _record(accept_failure, "fd=5", error=exhausted)
    assert limit.filter(quiet) and "suppressed" not in quiet.getMessage()


def test_the_log_filter_passes_other_messages_and_kinds_apart():
    clock = _Clock()
    limit = RateLimitFilter(10.0, applies_to=is_resource_exhaustion, clock=clock)
    for _ in range(3):  # not about resources: never limited
        assert limit.filter(_record("Task exception was never retrieved"))
    assert limit.filter(_record("accept failed", error=OSError(errno.ENFILE, "table full")))
    assert not limit.filter(_record("accept failed", error=OSError(errno.EMFILE, "x")))
    # Another message, or the same one from another logger, is another kind.
    assert limit.filter(_record("Too many open files in the core"))
    assert limit.filter(_record("accept failed", name="uvicorn.error",
                                error=OSError(errno.EMFILE, "x")))


class _SocketTransport:
    """What `GuardedH11Protocol.peer_closed` reads of an asyncio transport."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, name: str) -> socket.socket | None:
        return self.sock if name == "socket" else None


def test_peer_closed_sees_a_client_that_shut_its_side_with_its_bytes_unread() -> None:
    """As when uvicorn has paused reading a connection: the server reads nothing, yet the
    client's close shows on the socket."""
    with socket.create_server(("127.0.0.1", 0)) as listener, \
            socket.create_connection(listener.getsockname()) as client:
        served, _ = listener.accept()
        with served:
            protocol = SimpleNamespace(transport=_SocketTransport(served))
            client.sendall(b"x" * 16_384)  # left unread by the server; within its buffer
            assert GuardedH11Protocol.peer_closed(protocol) is False
            client.shutdown(socket.SHUT_WR)
            deadline_s = time.monotonic() + 10
            while not GuardedH11Protocol.peer_closed(protocol):
                assert time.monotonic() < deadline_s, "the close was never seen"
                time.sleep(0.01)
