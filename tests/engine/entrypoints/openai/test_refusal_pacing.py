"""The refusal pacer: a tenant refused again before its Retry-After has passed gets the
answer that late, at most `max_waiting_per_tenant` of its refusals wait at once, and tenants
never slow each other; over HTTP, a paced refusal's body is left unread while other tenants
are served."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from engine.entrypoints.openai.body_budget import BodyByteBudget
from engine.entrypoints.openai.refusal_pacing import PEER_CHECK_INTERVAL_S, RefusalPacer
from engine.entrypoints.openai.serving import ServerSettings
from engine.entrypoints.openai.tenants import Tenants
from tests.engine.entrypoints.openai.conftest import ServerThread, start_server


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


class GatedSleep:
    """A sleep that records each delay asked for and returns once `gate` is set."""

    def __init__(self) -> None:
        self.delays_s: list[float] = []
        self.gate = asyncio.Event()

    async def __call__(self, delay_s: float) -> None:
        self.delays_s.append(delay_s)
        await self.gate.wait()


def _pacer(max_waiting: int = 2) -> tuple[RefusalPacer, FakeClock, GatedSleep]:
    clock, sleep = FakeClock(), GatedSleep()
    return RefusalPacer(1.5, max_waiting, clock=clock, sleep=sleep), clock, sleep


def test_a_refusal_within_the_delay_of_the_previous_waits_the_delay() -> None:
    async def scenario() -> None:
        pacer, clock, sleep = _pacer()
        assert await pacer.pace("a") is False  # the tenant's first refusal
        clock.now_s = 1.4
        waiting = asyncio.ensure_future(pacer.pace("a"))
        await asyncio.sleep(0)
        assert not waiting.done() and pacer.waiting("a") == 1 and sleep.delays_s == [1.5]
        sleep.gate.set()
        assert await waiting is True and pacer.waiting("a") == 0
        clock.now_s = 1.4 + 1.5  # waited out its Retry-After since the latest refusal
        assert await pacer.pace("a") is False
        assert pacer.num_paced == 1

    asyncio.run(scenario())


def test_a_client_that_sends_again_as_soon_as_answered_is_paced_again() -> None:
    """The delay counts from when the previous refusal was answered, not made: one refusal
    after another, each sent as the last was answered, all but the first wait."""
    async def scenario() -> None:
        clock = FakeClock()

        async def sleep(delay_s: float) -> None:
            clock.now_s += delay_s

        pacer = RefusalPacer(1.5, clock=clock, sleep=sleep)
        assert await pacer.pace("a") is False
        clock.now_s = 0.1
        assert [await pacer.pace("a") for _ in range(3)] == [True] * 3
        assert clock.now_s == pytest.approx(0.1 + 3 * 1.5) and pacer.num_paced == 3
        clock.now_s += 1.5  # the client waited out its Retry-After
        assert await pacer.pace("a") is False

    asyncio.run(scenario())


def test_tenants_are_paced_apart() -> None:
    async def scenario() -> None:
        pacer, _, sleep = _pacer()
        assert await pacer.pace("a") is False
        assert await pacer.pace(None) is False  # the tenant of a server without keys
        assert await pacer.pace("b") is False
        assert sleep.delays_s == [] and pacer.num_paced == 0

    asyncio.run(scenario())


def test_past_the_most_waiting_a_tenants_refusals_are_answered_at_once() -> None:
    async def scenario() -> None:
        pacer, _, sleep = _pacer(max_waiting=2)
        await pacer.pace("a")
        waiting = [asyncio.ensure_future(pacer.pace("a")) for _ in range(2)]
        await asyncio.sleep(0)
        assert pacer.waiting("a") == 2
        assert await pacer.pace("a") is False  # a third would hold one connection more
        assert await pacer.pace("b") is False  # another tenant is not slowed
        sleep.gate.set()
        assert await asyncio.gather(*waiting) == [True, True]
        assert pacer.waiting("a") == 0 and pacer.num_paced == 2

    asyncio.run(scenario())


def test_no_refusal_waits_when_none_may() -> None:
    async def scenario() -> None:
        pacer, _, sleep = _pacer(max_waiting=0)
        assert [await pacer.pace("a") for _ in range(3)] == [False] * 3
        assert sleep.delays_s == []

    asyncio.run(scenario())


def test_a_cancelled_wait_is_no_longer_counted() -> None:
    async def scenario() -> None:
        pacer, _, _ = _pacer()
        await pacer.pace("a")
        waiting = asyncio.ensure_future(pacer.pace("a"))
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert pacer.waiting("a") == 0 and pacer.num_paced == 0  # never answered late

    asyncio.run(scenario())


def test_a_refusal_whose_client_went_away_stops_waiting_and_is_not_paced() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        slept_s: list[float] = []

        async def sleep(delay_s: float) -> None:
            slept_s.append(delay_s)
            clock.now_s += delay_s

        pacer = RefusalPacer(1.5, clock=clock, sleep=sleep)
        await pacer.pace("a")
        looks = iter([False, False, True])
        assert await pacer.pace("a", peer_closed=lambda: next(looks)) is False
        assert slept_s == [PEER_CHECK_INTERVAL_S] * 2
        assert pacer.waiting("a") == 0 and pacer.num_paced == 0
        # A client that stays waits the whole delay, in slices.
        slept_s.clear()
        assert await pacer.pace("a", peer_closed=lambda: False) is True
        assert sum(slept_s) == pytest.approx(1.5) and pacer.num_paced == 1

    asyncio.run(scenario())


@pytest.mark.parametrize(("delay_s", "max_waiting"), [(-1.0, 1), (1.0, -1)])
def test_negative_settings_are_refused(delay_s: float, max_waiting: int) -> None:
    with pytest.raises(ValueError, match="at least 0"):
        RefusalPacer(delay_s, max_waiting)


KEYS = {"alpha": "key-a", "beta": "key-b"}
BODY_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def paced_server() -> Iterator[ServerThread]:
    """Two tenants, each holding at most one 64 KiB body; refusals paced by 1 s; the
    connection protocol of `continuum serve`."""
    tenants = Tenants.from_pairs([(key, name) for name, key in KEYS.items()])
    running = start_server(api_key=KEYS["alpha"], guarded=True, settings=ServerSettings(
        served_model_name="tiny", tenants=tenants, max_request_body_bytes=BODY_BYTES,
        max_body_bytes_in_flight=2 * BODY_BYTES, retry_after_s=1))
    yield running
    running.stop()


def _post(server: ServerThread, tenant: str) -> tuple[httpx.Response, float]:
    """A completion of `tenant` and how long its answer took, seconds."""
    started_s = time.monotonic()
    with server.http(headers={"Authorization": f"Bearer {KEYS[tenant]}"}) as http:
        response = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi",
                                                      "max_tokens": 2})
    return response, time.monotonic() - started_s


def _until(condition: Callable[[], bool]) -> None:
    deadline_s = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline_s, "the condition never held"
        time.sleep(0.01)


def test_a_tenant_that_sends_again_at_once_gets_its_refusal_late(paced_server) -> None:
    """Alpha's share is held by one body sent all but its last byte: its first refusal is
    answered at once, the next, sent at once, after Retry-After, its body unread; beta is
    served meanwhile."""
    budget: BodyByteBudget = paced_server.app.state.body_budget
    pacer: RefusalPacer = paced_server.app.state.refusal_pacer
    host, port = paced_server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as holder:
        holder.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                        f"Authorization: Bearer {KEYS['alpha']}\r\n"
                        f"Content-Type: application/json\r\nContent-Length: {BODY_BYTES}"
                        f"\r\n\r\n").encode() + b" " * (BODY_BYTES - 1))
        _until(lambda: budget.tenant_held_bytes("alpha") == BODY_BYTES - 1)
        first, _ = _post(paced_server, "alpha")
        assert first.status_code == 429 and pacer.num_paced == 0
        answers: list[tuple[httpx.Response, float]] = []
        late = threading.Thread(target=lambda: answers.append(_post(paced_server, "alpha")))
        late.start()
        _until(lambda: pacer.waiting("alpha") == 1)
        assert _post(paced_server, "beta")[0].status_code == 200
        late.join(timeout=30)
        (second, second_s), = answers
        assert second.status_code == 429 and second.headers["retry-after"] == "1"
        assert second_s >= 1.0 and pacer.num_paced == 1
        assert budget.tenant_held_bytes("alpha") == BODY_BYTES - 1
        # Neither a body refused midway (chunked: no length to refuse it by), which holding
        # would hold what was read, nor one too large is paced.
        with paced_server.http(headers={"Authorization": f"Bearer {KEYS['alpha']}"}) as http:
            chunked = http.post("/v1/completions", content=iter([b" " * 1024] * 4))
            too_large = http.post("/v1/completions", content=b" " * (BODY_BYTES + 1))
        assert (chunked.status_code, too_large.status_code) == (429, 413)
        assert pacer.num_paced == 1
    _until(lambda: budget.held_bytes == 0)


def test_a_paced_refusal_whose_client_goes_away_gives_its_place_up(paced_server) -> None:
    """Alpha's share held, a refusal made at once, then one paced, of a client that waits
    for `100 Continue` before sending its body: it closes the connection while its refusal
    waits, and the wait ends without being counted as paced."""
    budget: BodyByteBudget = paced_server.app.state.body_budget
    pacer: RefusalPacer = paced_server.app.state.refusal_pacer
    host, port = paced_server.base_url.removeprefix("http://").split(":")
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
            f"Authorization: Bearer {KEYS['alpha']}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {BODY_BYTES}\r\n\r\n"
            ).encode()
    with socket.create_connection((host, int(port))) as holder:
        holder.sendall(head + b" " * (BODY_BYTES - 1))
        _until(lambda: budget.tenant_held_bytes("alpha") == BODY_BYTES - 1)
        assert _post(paced_server, "alpha")[0].status_code == 429
        num_paced = pacer.num_paced
        with socket.create_connection((host, int(port))) as leaving:
            leaving.sendall(head.replace(b"\r\n\r\n", b"\r\nExpect: 100-continue\r\n\r\n"))
            _until(lambda: pacer.waiting("alpha") == 1)
        _until(lambda: pacer.waiting("alpha") == 0)
        assert pacer.num_paced == num_paced
    _until(lambda: budget.held_bytes == 0)
