"""The body byte budget: a tenant's share and the server's total are never passed, a refusal
reserves nothing (over HTTP: its body is never read), and every reservation comes back."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import time
import weakref
from collections.abc import Callable, Iterator

import httpx
import pytest

from engine.entrypoints.openai.body_budget import (
    BodyByteBudget,
    BodyReservation,
    parse_content_length,
)
from engine.entrypoints.openai.errors import APIError
from engine.entrypoints.openai.serving import ServerSettings
from engine.entrypoints.openai.tenants import Tenants
from tests.engine.entrypoints.openai.conftest import ServerThread, start_server


@pytest.mark.parametrize(("num_tenants", "max_bytes", "largest_body_bytes", "share"), [
    (1, 1000, 100, 1000),   # one tenant: all of it
    (2, 1000, 100, 500),    # several: half each
    (5, 1000, 100, 500),
    (3, 1000, 800, 800),    # but at least one largest body
    (3, 1000, 1000, 1000),
])
def test_each_tenants_share(num_tenants, max_bytes, largest_body_bytes, share):
    budget = BodyByteBudget.for_tenants(num_tenants, max_bytes, largest_body_bytes)
    assert (budget.max_bytes, budget.max_bytes_per_tenant) == (max_bytes, share)


def test_a_total_below_the_largest_body_is_refused():
    with pytest.raises(ValueError, match="at least the largest request body"):
        BodyByteBudget.for_tenants(2, 999, 1000)
    with pytest.raises(ValueError, match="max_bytes_per_tenant"):
        BodyByteBudget(100, 101)


def _refusal(budget: BodyByteBudget, tenant: str | None, num_bytes: int) -> APIError:
    """The refusal of `num_bytes` more for `tenant`, by `check_room` and by `reserve` alike,
    neither of which changed anything."""
    held = (budget.held_bytes, budget.tenant_held_bytes(tenant))
    with pytest.raises(APIError) as checked:
        budget.check_room(tenant, num_bytes)
    with pytest.raises(APIError) as reserved:
        budget.reserve(tenant, num_bytes)
    assert (budget.held_bytes, budget.tenant_held_bytes(tenant)) == held
    assert checked.value.status_code == reserved.value.status_code
    return reserved.value


def test_past_its_share_a_tenant_gets_429_and_the_others_still_fit():
    budget = BodyByteBudget.for_tenants(2, 1000, 100, retry_after_s=7)
    budget.reserve("a", 400)
    budget.reserve("a", 100)
    refusal = _refusal(budget, "a", 1)
    assert refusal.status_code == 429
    assert refusal.code == "rate_limit_exceeded"
    assert refusal.headers == {"Retry-After": "7", "Connection": "close"}
    assert "share of 500" in refusal.message
    budget.check_room("b", 500)
    budget.reserve("b", 500)
    assert (budget.held_bytes, budget.tenant_held_bytes("a")) == (1000, 500)


def test_past_the_total_a_tenant_within_its_share_gets_503():
    budget = BodyByteBudget.for_tenants(3, 1000, 100)
    budget.reserve("a", 500)
    budget.reserve("b", 450)
    refusal = _refusal(budget, "c", 51)
    assert refusal.status_code == 503
    assert refusal.code == "server_busy"
    budget.reserve("c", 50)
    assert budget.held_bytes == 1000


def test_with_one_tenant_every_client_shares_the_total_and_gets_503():
    budget = BodyByteBudget.for_tenants(1, 1000, 100)
    budget.reserve(None, 1000)
    assert _refusal(budget, None, 1).status_code == 503


def test_releases_give_back_exactly_what_was_held():
    budget = BodyByteBudget(1000)
    budget.reserve(None, 300)
    budget.reserve(None, 0)
    with pytest.raises(ValueError, match="holds 300"):
        budget.release(None, 301)
    budget.release(None, 100)
    assert budget.tenant_held_bytes(None) == 200
    budget.release(None, 200)
    assert budget.held_bytes == 0
    with pytest.raises(ValueError):
        budget.reserve(None, -1)


def test_a_reservation_holds_what_was_read_not_what_was_declared():
    budget = BodyByteBudget.for_tenants(2, 1000, 100)
    reservation = budget.reservation("a")
    reservation.check_declared(500)
    assert budget.held_bytes == 0
    with pytest.raises(APIError):
        reservation.check_declared(501)
    reservation.cover(100, complete=False)
    reservation.cover(60, complete=False)    # read so far: already held
    assert budget.tenant_held_bytes("a") == 100
    reservation.cover(450, complete=False)
    with pytest.raises(APIError):
        reservation.cover(501, complete=False)
    assert (reservation.num_bytes, budget.held_bytes) == (450, 450)
    reservation.release()
    reservation.release()
    assert budget.held_bytes == 0
    assert not budget.is_arriving(reservation)


def _arriving(budget: BodyByteBudget, tenant: str | None, num_bytes: int) -> BodyReservation:
    reservation = budget.reservation(tenant)
    reservation.cover(num_bytes, complete=False)
    return reservation


def test_an_older_bodys_chunk_takes_the_room_of_the_youngest_of_its_tenant():
    budget = BodyByteBudget.for_tenants(2, 1000, 100, retry_after_s=3)
    oldest = _arriving(budget, "a", 100)
    complete = budget.reservation("a")
    complete.cover(100, complete=True)
    middle = _arriving(budget, "a", 150)
    youngest = _arriving(budget, "a", 150)
    other = _arriving(budget, "b", 400)
    # Its share is full (500): the chunk of 120 takes the youngest's 150, not more, and
    # never a complete body's or another tenant's.
    assert budget.hold(oldest, 120, arriving=True) == [youngest]
    oldest.num_bytes += 120
    assert youngest.refusal is not None and youngest.refusal.status_code == 429
    assert youngest.refusal.headers == {"Retry-After": "3", "Connection": "close"}
    assert "earlier request of this tenant" in youngest.refusal.message
    assert (youngest.num_bytes, budget.is_arriving(youngest)) == (0, False)
    assert (budget.tenant_held_bytes("a"), budget.tenant_held_bytes("b")) == (470, 400)
    assert budget.num_refused == {429: 1}
    with pytest.raises(APIError) as revoked:
        youngest.cover(200, complete=False)
    assert revoked.value is youngest.refusal
    youngest.release()
    # The youngest body left cannot take an older one's room: it is refused as before, and
    # is no longer among the bodies arriving (no older chunk can revoke it, counting it
    # refused twice).
    with pytest.raises(APIError):
        middle.cover(190, complete=False)
    assert middle.refusal is None and not budget.is_arriving(middle)
    assert budget.num_refused == {429: 2}
    for reservation in (oldest, complete, middle, other):
        reservation.release()
    assert budget.held_bytes == 0


def test_nothing_is_revoked_when_even_all_younger_bodies_would_not_make_room():
    budget = BodyByteBudget.for_tenants(2, 1000, 100)
    oldest = _arriving(budget, "a", 300)
    younger = _arriving(budget, "a", 100)
    with pytest.raises(APIError) as refused:
        oldest.cover(300 + 201, complete=False)
    assert refused.value.status_code == 429
    assert younger.refusal is None
    assert budget.tenant_held_bytes("a") == 400


def test_for_the_total_an_older_body_takes_the_room_of_tenants_holding_more():
    budget = BodyByteBudget.for_tenants(3, 1000, 100)
    oldest = _arriving(budget, "a", 200)
    younger_b = _arriving(budget, "b", 300)
    youngest_c = _arriving(budget, "c", 450)
    oldest.cover(300, complete=False)
    assert youngest_c.refusal is not None and youngest_c.refusal.status_code == 503
    assert younger_b.refusal is None
    assert budget.held_bytes == 600


def test_for_the_total_tenants_holding_no_more_keep_their_bodies():
    budget = BodyByteBudget.for_tenants(3, 1000, 100)
    oldest = _arriving(budget, "a", 450)
    same = _arriving(budget, "b", 450)
    smaller = _arriving(budget, "c", 100)
    with pytest.raises(APIError) as refused:
        oldest.cover(500, complete=False)
    assert refused.value.status_code == 503
    assert same.refusal is None and smaller.refusal is None


def test_for_the_total_an_older_body_takes_its_own_tenants_room_first():
    budget = BodyByteBudget.for_tenants(3, 1000, 100)
    oldest = _arriving(budget, "a", 200)
    own = _arriving(budget, "a", 50)
    other = _arriving(budget, "b", 400)
    _arriving(budget, "c", 300)
    oldest.cover(300, complete=False)
    assert own.refusal is not None and own.refusal.status_code == 503
    assert other.refusal is None


def test_a_body_is_as_old_as_its_first_bytes_not_its_request():
    budget = BodyByteBudget.for_tenants(2, 1000, 100)
    announced_first = budget.reservation("a")
    sending_first = _arriving(budget, "a", 100)
    announced_first.cover(350, complete=False)
    sending_first.cover(200, complete=False)
    assert announced_first.refusal is not None
    assert sending_first.refusal is None


def test_with_one_tenant_the_youngest_bodies_give_way_with_503():
    budget = BodyByteBudget.for_tenants(1, 1000, 100)
    oldest = _arriving(budget, None, 400)
    younger = [_arriving(budget, None, 300) for _ in range(2)]
    oldest.cover(700, complete=True)
    assert younger[0].refusal is None
    assert younger[1].refusal is not None and younger[1].refusal.status_code == 503
    assert not budget.is_arriving(oldest)


def test_a_reader_waiting_for_the_next_chunk_learns_of_its_revocation_at_once():
    budget = BodyByteBudget.for_tenants(2, 1000, 100)
    oldest = _arriving(budget, "a", 400)
    youngest = _arriving(budget, "a", 100)
    waited_on = []

    async def next_chunk() -> bytes:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            waited_on.append("cancelled")
            raise
        return b""

    async def last_message() -> str:
        return "disconnect"

    async def scenario() -> None:
        reading = asyncio.ensure_future(youngest.unless_revoked(next_chunk))
        await asyncio.sleep(0.01)
        assert not reading.done()
        oldest.cover(480, complete=False)
        with pytest.raises(APIError) as refused:
            await asyncio.wait_for(reading, 5)
        assert refused.value.status_code == 429
        assert waited_on == ["cancelled"]
        # A body no longer arriving is read without a watch, and cannot be revoked.
        oldest.cover(480, complete=True)
        assert await oldest.unless_revoked(last_message) == "disconnect"

    asyncio.run(scenario())


class Chunks:
    """Stands for the body read so far, which only its reader's frame refers to."""


def _chunks_freed_after_refusal(reservation: BodyReservation,
                                read: Callable[[], object]) -> bool:
    """Whether the body read so far (a `Chunks` that only the reader's frame refers to) is
    freed by reference counting alone, with the cyclic GC off, once `read()` has raised its
    refusal and `reservation` is released."""
    def read_on(chunks: Chunks) -> None:
        read()

    chunks = Chunks()
    alive = weakref.ref(chunks)
    gc.disable()
    try:
        with contextlib.suppress(APIError):
            read_on(chunks)
        del chunks
        reservation.release()
        return alive() is None
    finally:
        gc.enable()


def test_a_revoked_readers_frames_are_freed_with_its_reservation():
    """The refusal a revoked reservation raises holds the reader's frames through its
    traceback; once the reservation is released, they (and the body read so far) are freed
    by reference counting alone."""
    budget = BodyByteBudget.for_tenants(2, 1000, 100)
    oldest = _arriving(budget, "a", 400)
    youngest = _arriving(budget, "a", 100)
    oldest.cover(480, complete=False)  # revokes the youngest
    assert _chunks_freed_after_refusal(youngest,
                                       lambda: youngest.cover(200, complete=False))


@pytest.mark.parametrize("refused_by", ["cover", "check_declared"])
def test_a_refused_readers_frames_are_freed_with_its_request(refused_by: str):
    """A body refused by its own chunk (no younger body to take room from), or by its
    declared length, is freed with its reader by reference counting alone: the refusal's
    traceback holds the reader's frames, and no frame of the budget holds the refusal."""
    budget = BodyByteBudget.for_tenants(2, 1000, 100)
    _arriving(budget, "a", 500)
    reservation = budget.reservation("a")
    read = ((lambda: reservation.cover(100, complete=False)) if refused_by == "cover"
            else (lambda: reservation.check_declared(100)))
    assert _chunks_freed_after_refusal(reservation, read)


@pytest.mark.parametrize(("value", "length"), [
    (b"0", 0), (b"65536", 65536), ("12", 12), (b"9" * 20, int("9" * 20)),
    (b"", None), (b"-1", None), (b"+1", None), (b" 1", None), (b"1.0", None),
    ("\u00b2", None), ("\u0661", None), (b"9" * 21, None), (b"9" * 5000, None),
])
def test_content_lengths_are_ascii_digits_only(value, length):
    assert parse_content_length(value) == length


KEYS = {"alpha": "key-a", "beta": "key-b", "gamma": "key-c"}
MAX_BODY_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def budget_server() -> Iterator[ServerThread]:
    """Three tenants; bodies of up to 64 KiB, 256 KiB of them at once, 128 KiB a tenant."""
    tenants = Tenants.from_pairs([(key, name) for name, key in KEYS.items()])
    running = start_server(api_key=KEYS["alpha"], settings=ServerSettings(
        served_model_name="tiny", tenants=tenants, max_request_body_bytes=MAX_BODY_BYTES,
        max_body_bytes_in_flight=4 * MAX_BODY_BYTES, retry_after_s=2))
    yield running
    running.stop()


def _headers(tenant: str, num_bytes: int) -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
            f"Authorization: Bearer {KEYS[tenant]}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {num_bytes}\r\n\r\n").encode()


def _held_bodies(server: ServerThread, tenant: str, count: int, num_bytes: int
                 ) -> list[socket.socket]:
    """`count` connections that each sent a completion's headers, declaring a body of
    `num_bytes`, and all of that body but its last byte, once the server holds what they
    sent (the tenant held nothing before)."""
    budget: BodyByteBudget = server.app.state.body_budget
    _until(lambda: budget.tenant_held_bytes(tenant) == 0)
    held = []
    for _ in range(count):
        sock = socket.create_connection(_address(server))
        held.append(sock)
        sock.sendall(_headers(tenant, num_bytes) + b" " * (num_bytes - 1))
    _until(lambda: budget.tenant_held_bytes(tenant) == count * (num_bytes - 1))
    return held


def _address(server: ServerThread) -> tuple[str, int]:
    host, port = server.base_url.removeprefix("http://").split(":")
    return host, int(port)


def _until(condition: Callable[[], bool]) -> None:
    deadline_s = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline_s, "the condition never held"
        time.sleep(0.01)


def _complete(server: ServerThread, tenant: str) -> httpx.Response:
    with server.http(headers={"Authorization": f"Bearer {KEYS[tenant]}"}) as http:
        return http.post("/v1/completions", json={"model": "tiny", "prompt": "hi",
                                                  "max_tokens": 2})


def _close_all(server: ServerThread, socks: list[socket.socket]) -> None:
    """Closes the connections; their requests' bytes come back."""
    for sock in socks:
        sock.close()
    budget: BodyByteBudget = server.app.state.body_budget
    _until(lambda: budget.held_bytes == 0)


def test_held_bodies_past_a_share_or_the_total_are_refused(budget_server):
    budget: BodyByteBudget = budget_server.app.state.body_budget
    held = _held_bodies(budget_server, "alpha", 2, MAX_BODY_BYTES)
    try:
        refused = _complete(budget_server, "alpha")
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert refused.headers["retry-after"] == "2"
        # Another tenant's request still fits; then it holds its own share too.
        assert _complete(budget_server, "beta").status_code == 200
        held += _held_bodies(budget_server, "beta", 2, MAX_BODY_BYTES)
        busy = _complete(budget_server, "gamma")
        assert busy.status_code == 503, busy.text
        assert busy.json()["error"]["code"] == "server_busy"
        assert budget.held_bytes == 4 * (MAX_BODY_BYTES - 1)
        assert budget_server.metric("request_body_bytes_held") == budget.held_bytes
        for status in ("429", "503"):
            assert budget_server.metric("request_bodies_refused_total",
                                        f'status="{status}"') >= 1
    finally:
        _close_all(budget_server, held)
    assert _complete(budget_server, "gamma").status_code == 200
    _until(lambda: budget.held_bytes == 0)
    stats = budget_server.wait_idle()
    assert stats.num_free_blocks == stats.num_kv_blocks


def test_announced_bodies_hold_nothing_and_one_that_cannot_fit_is_refused_unread(
        budget_server):
    budget: BodyByteBudget = budget_server.app.state.body_budget
    announced = []
    for _ in range(4):
        sock = socket.create_connection(_address(budget_server))
        announced.append(sock)
        sock.sendall(_headers("alpha", MAX_BODY_BYTES))
    _until(lambda: budget_server.num_requests_in_progress == 4)
    try:
        # Four bodies of 64 KiB announced and none sent: the tenant may still send its own.
        assert _complete(budget_server, "alpha").status_code == 200
        held = _held_bodies(budget_server, "alpha", 2, MAX_BODY_BYTES)
        with socket.create_connection(_address(budget_server), timeout=30) as sock:
            sock.sendall(_headers("alpha", MAX_BODY_BYTES))
            assert sock.recv(4096).startswith(b"HTTP/1.1 429")
        assert budget.tenant_held_bytes("alpha") == 2 * (MAX_BODY_BYTES - 1)
    finally:
        _close_all(budget_server, announced + held)


def test_a_chunked_body_is_refused_once_its_chunks_pass_the_share(budget_server):
    budget: BodyByteBudget = budget_server.app.state.body_budget
    held = _held_bodies(budget_server, "alpha", 2, 60 * 1024)

    def chunks() -> Iterator[bytes]:
        yield b'{"model": "tiny", "prompt": "hi",' + b" " * 16 * 1024
        yield b'"max_tokens": 2}'

    try:
        with budget_server.http(headers={"Authorization": f"Bearer {KEYS['alpha']}",
                                         "Content-Type": "application/json"}) as http:
            refused = http.post("/v1/completions", content=chunks())
        assert refused.status_code == 429, refused.text
        assert budget.tenant_held_bytes("alpha") == 2 * (60 * 1024 - 1)
    finally:
        _close_all(budget_server, held)
    with budget_server.http(headers={"Authorization": f"Bearer {KEYS['alpha']}",
                                     "Content-Type": "application/json"}) as http:
        served = http.post("/v1/completions", content=chunks())
    assert served.status_code == 200, served.text
    _until(lambda: budget.held_bytes == 0)


def test_an_older_body_completes_and_the_youngest_gives_its_room_back(budget_server):
    budget: BodyByteBudget = budget_server.app.state.body_budget
    kib = 1024
    prefix = b'{"model": "tiny", "prompt": "hi", "max_tokens": 2'
    oldest_body = prefix + b" " * (64 * kib - len(prefix) - 1) + b"}"
    socks = []

    def send_part(num_bytes_declared: int, part: bytes, held_after: int) -> socket.socket:
        sock = socket.create_connection(_address(budget_server), timeout=30)
        socks.append(sock)
        sock.sendall(_headers("alpha", num_bytes_declared) + part)
        _until(lambda: budget.tenant_held_bytes("alpha") == held_after)
        return sock

    try:
        # Each declared length fits when it is sent; together the three fill the share
        # (128 KiB) but for 4 KiB.
        oldest = send_part(64 * kib, oldest_body[:16 * kib], 16 * kib)
        send_part(56 * kib, b" " * 48 * kib, 64 * kib)
        youngest = send_part(64 * kib, b" " * 60 * kib, 124 * kib)
        oldest.sendall(oldest_body[16 * kib:])
        assert youngest.recv(4096).startswith(b"HTTP/1.1 429")
        assert oldest.recv(4096).startswith(b"HTTP/1.1 200")
        _until(lambda: budget.tenant_held_bytes("alpha") == 48 * kib)
    finally:
        _close_all(budget_server, socks)
