"""The replicated server as a Ray Serve application: N engine replicas behind one ingress.

- **`EngineReplica`** (N replicas): one engine (`AsyncLLM` and its core process) and the whole
  OpenAI-compatible app of `continuum serve`, through which the ingress's requests run
  in-process (`engine.replicas.asgi`), so every endpoint behaves as on a single server. A
  replica whose engine core died fails Ray Serve's health check and is restarted by it.
- **`Ingress`** (one replica, the HTTP entry): reads each request's routing key
  (`engine.replicas.routing_key`; of a body over `INLINE_PARSE_BYTES` in a child process,
  as a single server parses such a body, so that parsing it does not hold the event loop
  that relays every tenant's stream), forwards the request through a deployment
  handle whose request router is `ReplicaRequestRouter`, and streams the replica's response
  back. `GET /metrics` merges every replica's series, labelled by replica, with the
  ingress's own.

**Faults.** A request whose replica dies before the ingress forwarded any of the response is
sent once more (the router no longer sees the dead replica, so it goes to another); a response
cut off later ends with an error (an SSE error event, or the connection closes). The dead
replica's jobs lose their pins; their next turns are routed again over the live replicas.

**Stopping.** `stop_application` (SIGTERM to `continuum serve --replicas`) drains every
replica as a single server drains, then deletes the application.

Build it with `build_application` (what `continuum serve --replicas N` runs), or from a Serve
config with `app_builder` (`serve run engine.replicas.ray_app:app_builder ...`).
"""


import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import shlex
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Mapping
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from starlette.requests import ClientDisconnect

from engine.engine_args import EngineArgs
from engine.entrypoints.openai.body_budget import (
    BodyRefused,
    BodyReservation,
    parse_content_length,
)
from engine.entrypoints.openai.errors import (
    APIError,
    api_error_response,
    error_body,
    error_response,
    invalid_api_key_response,
)
from engine.entrypoints.openai.json_body import (
    INLINE_PARSE_BYTES,
    BodyParser,
    ChildAnswerTimeout,
)
from engine.entrypoints.openai.metrics import body_budget_families
from engine.entrypoints.openai.serving import sse
from engine.entrypoints.openai.tenants import UNAUTHENTICATED_PATHS
from engine.entrypoints.server_args import add_arguments, server_settings_from_args
from engine.frontend.async_llm import AsyncLLM
from engine.frontend.stats import RequestStatsObserver
from engine.replicas.asgi import ProxiedRequest, ResponseHead, call_asgi
from engine.replicas.ray_router import ReplicaRequestRouter
from engine.replicas.replica_metrics import merge_replicas, render, routing_decisions
from engine.replicas.routing import (
    DEFAULT_LOAD_FACTOR,
    DEFAULT_MIN_MOVE_LOAD,
    Route,
    RoutePurpose,
    RouterName,
    make_router,
)
from engine.replicas.routing_key import BodyRoute, body_route, job_key

logger = logging.getLogger("continuum.replicas")

REPLICA_HEADER = b"x-continuum-replica"
ROUTE_HEADER = b"x-continuum-route"
MAX_REMEMBERED_RESPONSES = 100_000
# Ray Serve's own cap on requests in flight at a replica; the engine queues and batches, and
# `--max-waiting-requests` is the admission limit, so this only guards against runaway load.
MAX_ONGOING_REQUESTS_PER_REPLICA = 4096
ENGINE_STOP_MARGIN_S = 5.0
_REPLICA_FAILURES = (RayActorError, ActorUnavailableError)
_GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses",
                               "/v1/messages"})


@dataclass(frozen=True)
class ReplicaAppSettings:
    """The application: `num_replicas` engines, each started from `continuum serve`'s parsed
    flags `serve_args`, each holding `replica_num_cpus` CPUs and `replica_num_gpus` GPUs of
    the Ray cluster; requests routed by `router` (the affinity router's load bound:
    `load_factor`, `min_move_load`)."""

    serve_args: Mapping[str, Any]
    num_replicas: int = 2
    router: RouterName = "affinity"
    load_factor: float = DEFAULT_LOAD_FACTOR
    min_move_load: int = DEFAULT_MIN_MOVE_LOAD
    replica_num_cpus: float = 1.0
    replica_num_gpus: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas!r}")
        if self.replica_num_cpus < 0 or self.replica_num_gpus < 0:
            raise ValueError("replica_num_cpus and replica_num_gpus must be >= 0")
        # The router is built inside Ray, where an error (an unknown router, a bad load bound)
        # would leave every request waiting.
        make_router(self.router, load_factor=self.load_factor, min_move_load=self.min_move_load)


class EngineReplica:
    """One engine and its OpenAI-compatible app, serving the requests the ingress forwards."""

    async def __init__(self, serve_args: Mapping[str, Any]) -> None:
        from engine.entrypoints.openai.api_server import build_app

        self._lifespan: contextlib.AbstractAsyncContextManager[None] | None = None
        args = argparse.Namespace(**serve_args)
        config = EngineArgs.from_cli_args(args).to_engine_config()
        # The ingress paces its refusals; a replica gets bodies the ingress has read whole,
        # so holding its refusal would only hold them longer.
        settings = dataclasses.replace(server_settings_from_args(args),
                                       max_paced_refusals_per_tenant=0)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._engine_died = False
        self._decisions: Counter[str] = Counter()

        def make_engine(observer: RequestStatsObserver) -> AsyncLLM:
            return AsyncLLM(config, stats_observer=observer)

        self._app = build_app(make_engine, settings, on_engine_dead=self._on_engine_dead)
        lifespan = self._app.router.lifespan_context(self._app)
        await lifespan.__aenter__()
        self._lifespan = lifespan
        logger.info("replica %s serves %s", self.replica_id, settings.served_model_name)

    async def handle(self, request: ProxiedRequest,
                     route: Route) -> AsyncIterator[ResponseHead | bytes]:
        """Runs `request` through the app: yields the response head (with the replica and
        routing decision as headers), then the body's chunks."""
        kind = route.decision.kind if route.decision is not None else "spread"
        self._decisions[kind] += 1
        async with contextlib.aclosing(call_asgi(self._app, request)) as response:
            async for item in response:
                if isinstance(item, ResponseHead):
                    item = ResponseHead(item.status, (*item.headers,
                                                      (REPLICA_HEADER, self.replica_id.encode()),
                                                      (ROUTE_HEADER, kind.encode())))
                yield item

    async def metrics(self, headers: tuple[tuple[bytes, bytes], ...],
                      route: Route) -> tuple[str, int, bytes]:
        """This replica's id, and the status and body of its `GET /metrics` (authenticated
        with `headers`) followed by the routing decisions it received."""
        request = ProxiedRequest("GET", "/metrics", b"", headers, b"")
        chunks = [item async for item in call_asgi(self._app, request)]
        head = chunks[0]
        assert isinstance(head, ResponseHead)
        body = b"".join(chunk for chunk in chunks[1:] if isinstance(chunk, bytes))
        if head.status == 200:
            body += render([routing_decisions(self._decisions)])
        return self.replica_id, head.status, body

    async def begin_drain(self, route: Route) -> str:
        """Starts this replica's drain, as SIGTERM starts a single server's: new generations
        get 503, and requests still running after `--shutdown-timeout-s` end with a
        `server_shutting_down` error. Returns this replica's id. Called through the ingress
        (`Ingress.drain`) before the application is deleted, so that the replicas answer 503
        meanwhile and Ray Serve's shutdown finds nothing left to wait for."""
        from engine.entrypoints.openai.api_server import begin_drain

        begin_drain(self._app)
        return self.replica_id

    async def wait_drained(self, route: Route) -> str:
        """Returns this replica's id once its drain left no request in flight (at most the
        drain's timeout and `ENGINE_STOP_MARGIN_S` after it began)."""
        drain = self._app.state.drain
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(drain.wait_until_idle(self._app.state.engine),
                                   drain.timeout_s + ENGINE_STOP_MARGIN_S)
        return self.replica_id

    def check_health(self) -> None:
        """Ray Serve's periodic health check: a replica whose engine core died is restarted."""
        if self._engine_died:
            raise RuntimeError(f"replica {self.replica_id}: the engine core died")

    async def __del__(self) -> None:
        if self._lifespan is not None:
            await self._lifespan.__aexit__(None, None, None)

    def _on_engine_dead(self) -> None:
        self._engine_died = True


def _headers(request: Request) -> tuple[tuple[bytes, bytes], ...]:
    return tuple((key, value) for key, value in request.headers.raw if key.lower() != b"host")


def _response_headers(head: ResponseHead) -> dict[str, str]:
    # Ray Serve's proxy sets its own X-Request-Id (the same id, which the app echoes).
    skipped = {b"content-length", b"transfer-encoding", b"connection", b"x-request-id"}
    return {key.decode(): value.decode(errors="replace") for key, value in head.headers
            if key.lower() not in skipped}


def _json_or_none(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError):  # a replica's answer echoes the client's nesting
        return None


def _lowercase_headers(request: ProxiedRequest) -> dict[str, str]:
    """The request's headers by lower-cased name, as `routing_key` reads them."""
    return {key.decode().lower(): value.decode(errors="replace")
            for key, value in request.headers}


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A Responses API answer the ingress returned: its conversation's routing key and the
    replica that stores it."""

    key: str | None
    replica_id: str


def _replica_of(head: ResponseHead) -> str | None:
    replica_id = head.header(REPLICA_HEADER)
    return None if replica_id is None else replica_id.decode()


def _engine_died(head: ResponseHead, first: bytes) -> bool:
    return head.status == 503 and b'"engine_dead"' in first


async def _names_something_unknown(response: Response) -> bool:
    """Whether `response` (not sent yet) is a 404, or a 400 for an unknown previous response;
    reads such an answer's body, which is short."""
    if response.status_code not in (400, 404):
        return False
    if response.status_code == 404:
        return True
    assert isinstance(response, StreamingResponse)
    chunks = [chunk async for chunk in response.body_iterator]
    body = b"".join(chunk if isinstance(chunk, bytes) else chunk.encode() for chunk in chunks)
    response.body_iterator = _replay(body)
    return b'"param":"previous_response_id"' in body


async def _replay(body: bytes) -> AsyncIterator[bytes]:
    yield body


async def _drain(response: Response | None) -> None:
    """Reads a response that will not be sent (short), so its replica call ends."""
    if isinstance(response, StreamingResponse):
        async for _ in response.body_iterator:
            pass


def _response_id(first: bytes) -> str | None:
    """The response id in a Responses API answer's first chunk: the JSON body, or the data of
    the stream's `response.created` event."""
    for line in first.splitlines():
        text = line.removeprefix(b"data: ")
        if not text.startswith(b"{"):
            continue
        payload = _json_or_none(text)
        if isinstance(payload, dict):
            inner = payload.get("response", payload)
            if isinstance(inner, dict) and isinstance(inner.get("id"), str):
                return inner["id"]
    return None


# Defined after the helpers above: Ray Serve captures the class when it decorates it.
proxy_app = FastAPI(title="Continuum engine (replicated)", docs_url=None, redoc_url=None,
                    openapi_url=None)


@serve.ingress(proxy_app)
class Ingress:
    """The HTTP entry: routes each request to an engine replica and relays its response.
    Owns, besides its body budget, a work pool and the `BodyParser` children (up to the
    pool's background threads, spawned as large bodies need them) that read large bodies'
    routes; both stop in `__del__`."""

    def __init__(self, replicas: DeploymentHandle, num_replicas: int,
                 serve_args: dict[str, Any]) -> None:
        self._replicas = replicas
        self._num_replicas = num_replicas
        self._first_replica_asked = 0  # rotates, so that requests asked of each spread out
        settings = server_settings_from_args(argparse.Namespace(**serve_args))
        self._max_request_body_bytes = settings.max_request_body_bytes
        # The replicas check keys too; checking here first keeps an unauthenticated client
        # from making this process read (and hold) its body.
        self._tenants = settings.tenants
        # As a single server's (each replica has its own as well): the bodies this process
        # has read, each held until its replica's answer has begun (until then the ingress
        # may send it again, to another replica).
        self._body_budget = settings.body_budget()
        self._refusal_pacer = settings.refusal_pacer()
        # As a single server's: large bodies' routes are read in children, asked in their
        # tenants' turns on the pool's background threads.
        self._work_pool = settings.work_pool()
        self._body_parser = BodyParser(self._work_pool.num_background_threads,
                                       cpu_class=settings.large_body_cpu)
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()
        self._retries = 0
        self._cut_off = 0
        self._routes_unread = 0

    def __del__(self) -> None:
        # Called by Ray Serve as it stops the replica, even after an `__init__` that failed
        # before these were made.
        if (pool := getattr(self, "_work_pool", None)) is not None:
            pool.shutdown()
        if (parser := getattr(self, "_body_parser", None)) is not None:
            parser.shutdown()

    @proxy_app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        if not self._authenticated(request):
            return invalid_api_key_response()
        headers = _headers(request)
        texts: dict[str, str] = {}
        for index in range(self._num_replicas):
            route = Route(None, "replica", replica_index=index)
            try:
                replica_id, status, body = await self._replicas.metrics.remote(headers,
                                                                               route=route)
            except _REPLICA_FAILURES:
                continue  # restarting: its series are back at the next scrape
            if status != 200:
                return Response(body, status_code=status, media_type="application/json")
            texts[replica_id] = body.decode()
        return Response(merge_replicas(texts, self._own_metrics()),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @proxy_app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def forward(self, path: str, request: Request) -> Response:
        """Reads the request's body (holding its bytes in the ingress's budget) and relays
        the request to a replica; the answer, once the replica's has begun."""
        if not self._authenticated(request):
            return invalid_api_key_response()
        reservation = self._body_budget.reservation(self._tenant(request))
        try:
            body = await self._read_body(request, reservation)
            if body is None:
                return error_response(413, f"the request body exceeds the limit of "
                                      f"{self._max_request_body_bytes} bytes",
                                      code="request_too_large", headers={"Connection": "close"})
            return await self._forward(request, self._tenant(request), body)
        except APIError as refusal:
            return api_error_response(refusal)
        finally:
            reservation.release()

    async def _forward(self, request: Request, tenant: str | None, body: bytes) -> Response:
        proxied = ProxiedRequest(request.method, request.url.path,
                                 request.url.query.encode(), _headers(request), body)
        if request.method == "POST" and proxied.path in _GENERATION_PATHS:
            route = await self._generation_route(proxied, tenant)
        else:
            route = self._route(proxied)
        if route is None:
            return await self._ask_each_replica(proxied)
        response = await self._send(proxied, route)
        if response.status_code == 404 and route.purpose != "generate":
            await _drain(response)
            return await self._ask_each_replica(proxied)  # e.g. an inferred job
        return response

    async def drain(self) -> list[str]:
        """Drains every replica (`EngineReplica.begin_drain`, then `wait_drained`, so that
        all drain at once); returns, once they are drained, the ids of those that were (a
        replica restarting meanwhile is left out)."""
        begun: list[str] = []
        for method in (self._replicas.begin_drain, self._replicas.wait_drained):
            begun.clear()
            for index in range(self._num_replicas):
                route = Route(None, "replica", replica_index=index)
                with contextlib.suppress(*_REPLICA_FAILURES):
                    begun.append(await method.remote(route=route))
        return begun

    def _authenticated(self, request: Request) -> bool:
        """Whether the request may go on: no keys, a path open to all, or a known key."""
        return (self._tenants is None or request.url.path in UNAUTHENTICATED_PATHS
                or self._tenant(request) is not None)

    def _tenant(self, request: Request) -> str | None:
        """The tenant of the request's key (None without keys, or without a known key)."""
        return None if self._tenants is None else self._tenants.tenant_of_request(request.scope)

    async def _read_body(self, request: Request, reservation: BodyReservation
                         ) -> bytes | None:
        """The body, or None once it exceeds the limit (by its Content-Length, or as read);
        its bytes held in `reservation` as they are read. APIError 429 or 503 when the budget
        has no room for them (for a declared length that does not fit, before any is read,
        and then as late as the ingress's `RefusalPacer` says), or gives their room to an
        older body."""
        declared = parse_content_length(request.headers.get("content-length", ""))
        if declared is not None:
            if declared > self._max_request_body_bytes:
                return None
            try:
                reservation.check_declared(declared)
            except BodyRefused:
                await self._refusal_pacer.pace(reservation.tenant)
                raise
        chunks: list[bytes] = []
        num_bytes = 0
        more_body = True
        while more_body:
            message = await reservation.unless_revoked(request.receive)
            if message["type"] == "http.disconnect":
                raise ClientDisconnect
            if chunk := message.get("body", b""):
                chunks.append(chunk)
                num_bytes += len(chunk)
            if num_bytes > self._max_request_body_bytes:
                reservation.stop_arriving()
                return None
            more_body = bool(message.get("more_body"))
            reservation.cover(num_bytes, complete=not more_body)
        # Appending each chunk to one buffer here, then copying it out, held this loop for
        # about a quarter of its busy time under `python -m lab bodies --attack chats` (2026-11-26).
        return await self._body_parser.joined(chunks)

    async def _generation_route(self, request: ProxiedRequest, tenant: str | None
                                ) -> Route | None:
        """How generation `request` of `tenant` is routed, by its `BodyRoute`; None: ask
        each replica in turn (a Responses follow-up of a response this ingress does not know,
        or a large Responses body whose parsing children died or did not answer: any other
        is then load-balanced). APIError 429 when the tenant already has the work pool's
        most bodies waiting for a child, 503 once the ingress stops."""
        read_route = functools.partial(body_route, request.path, _lowercase_headers(request))
        # As a single server parses a body: a larger one would hold this loop, which relays
        # every tenant's stream, for milliseconds to seconds (an 8 MB chat: 8 ms; 15 MB of
        # Responses items: 0.3 s; just under 1 MiB of nested lists: 0.15-0.3 s), and no
        # cheap count of its bytes bounds that (nested lists have no commas, for one).
        if len(request.body) <= INLINE_PARSE_BYTES:
            route = read_route(request.body)
        else:
            try:
                route = await self._work_pool.run(tenant, self._body_parser.summary,
                                                  request.body, read_route, background=True)
            except (BrokenProcessPool, ChildAnswerTimeout):
                self._routes_unread += 1
                logger.warning("the ingress's body-parsing processes failed; a Responses "
                               "request is asked of each replica in turn, any other is "
                               "load-balanced")
                # Only a Responses follow-up is bound to a replica, which only they know.
                return None if request.path == "/v1/responses" else Route(None)
        return self._route_of_body(request.path, route)

    def _route_of_body(self, path: str, route: BodyRoute) -> Route | None:
        """The route of a generation to `path` whose body reads as `route`."""
        previous = route.previous_response_id
        if path == "/v1/responses" and previous is not None:
            stored = self._responses.get(previous)
            return None if stored is None else Route(stored.key, replica_id=stored.replica_id)
        return Route(route.key)

    def _route(self, request: ProxiedRequest) -> Route | None:
        """How `request`, not a generation, is routed; None: ask each replica in turn (a
        stored response this ingress does not know)."""
        path = request.path
        headers = _lowercase_headers(request)
        if path.startswith("/v1/jobs/"):
            purpose: RoutePurpose = "end_job" if request.method == "DELETE" else "lookup"
            return Route(job_key(path.removeprefix("/v1/jobs/"), headers), purpose)
        if path.startswith("/v1/responses/"):  # a stored response, its input_items or cancel
            stored = self._responses.get(path.removeprefix("/v1/responses/").split("/", 1)[0])
            return None if stored is None else Route(None, "replica",
                                                     replica_id=stored.replica_id)
        return Route(None)

    async def _send(self, request: ProxiedRequest, route: Route) -> Response:
        """Forwards `request`; sends it once more, to another replica, if its replica died
        (or answered that its engine died) before answering."""
        for attempt in range(2):
            response = self._replicas.options(stream=True).handle.remote(request, route=route)
            try:
                head = await response.__anext__()
                first = await anext(response, b"")
            except _REPLICA_FAILURES as error:
                response.cancel()
                if attempt == 0:
                    self._retries += 1
                    logger.warning("a replica died before answering; retrying once: %s", error)
                    continue
                return error_response(503, "the engine replica serving this request died "
                                      "before answering, and so did the one it was retried on",
                                      code="replica_unavailable")
            except Exception as error:
                response.cancel()
                logger.exception("forwarding a request failed")
                return error_response(503, f"no engine replica could take the request "
                                      f"({type(error).__name__})", code="replica_unavailable")
            assert isinstance(head, ResponseHead) and isinstance(first, bytes)
            # A request bound to one replica (a stored response's, or asking each in turn)
            # has no other replica to go to.
            retriable = route.replica_id is None and route.purpose != "replica"
            if attempt == 0 and retriable and _engine_died(head, first):
                response.cancel()
                self._retries += 1
                route = dataclasses.replace(route, avoid_replica_id=_replica_of(head))
                continue
            self._remember_response(request, route, head, first)
            return StreamingResponse(self._relay(first, response, head), status_code=head.status,
                                     headers=_response_headers(head))
        raise AssertionError("unreachable")

    async def _relay(self, first: bytes, response: Any, head: ResponseHead
                     ) -> AsyncIterator[bytes]:
        try:
            if first:
                yield first
            async for chunk in response:
                yield chunk
        except _REPLICA_FAILURES:
            self._cut_off += 1
            if (head.header(b"content-type") or b"").startswith(b"text/event-stream"):
                yield sse(error_body(503, "the engine replica serving this stream died",
                                     code="replica_unavailable"))
                return
            raise
        finally:
            response.cancel()

    async def _ask_each_replica(self, request: ProxiedRequest) -> Response:
        """Sends `request` to each replica in turn until one knows what it names (a stored
        response, a job): answers other than 404, a previous response not found and 503.
        When none does, the last such answer (a 503 first). Each request starts at the
        replica after the one the previous request started at: a Responses request whose
        route could not be read, which any replica serves, is spread over them."""
        unavailable: Response | None = None
        unknown: Response | None = None
        first = self._first_replica_asked
        self._first_replica_asked = (first + 1) % self._num_replicas
        for index in range(first, first + self._num_replicas):
            response = await self._send(request, Route(None, "replica", replica_index=index))
            if response.status_code != 503 and not await _names_something_unknown(response):
                for discarded in (unavailable, unknown):
                    await _drain(discarded)
                return response
            if response.status_code == 503:
                await _drain(unavailable)
                unavailable = response
            else:
                await _drain(unknown)
                unknown = response
        if unavailable is not None:
            await _drain(unknown)
            return unavailable
        assert unknown is not None
        return unknown

    def _remember_response(self, request: ProxiedRequest, route: Route, head: ResponseHead,
                           first: bytes) -> None:
        if request.path != "/v1/responses" or request.method != "POST" or head.status != 200:
            return
        response_id, replica_id = _response_id(first), _replica_of(head)
        if response_id is None or replica_id is None:
            return
        self._responses[response_id] = StoredResponse(route.key, replica_id)
        while len(self._responses) > MAX_REMEMBERED_RESPONSES:
            self._responses.popitem(last=False)

    def _own_metrics(self) -> list[Metric]:
        retries = CounterMetricFamily(
            "continuum:replica_retries", "Requests sent again because their replica died "
            "(or its engine did) before answering", value=self._retries)
        cut_off = CounterMetricFamily(
            "continuum:replica_cut_off_responses", "Responses cut off because their replica "
            "died while streaming", value=self._cut_off)
        unread = CounterMetricFamily(
            "continuum:ingress_routes_unread", "Large generation bodies whose route the "
            "ingress's parsing processes failed to read (a Responses request was then asked "
            "of each replica in turn, any other load-balanced)", value=self._routes_unread)
        budget = body_budget_families(self._body_budget, self._refusal_pacer,
                                      prefix="continuum:ingress_")
        return [retries, cut_off, unread, *budget]


def build_application(settings: ReplicaAppSettings) -> serve.Application:
    """The Ray Serve application of `settings` (for `serve.run`)."""
    router_config = RequestRouterConfig(
        request_router_class=ReplicaRequestRouter,
        request_router_kwargs={"router": settings.router, "seed": settings.seed,
                               "load_factor": settings.load_factor,
                               "min_move_load": settings.min_move_load},
    )
    replicas = serve.deployment(EngineReplica).options(
        name="EngineReplica", num_replicas=settings.num_replicas,
        max_ongoing_requests=MAX_ONGOING_REQUESTS_PER_REPLICA,
        request_router_config=router_config, health_check_period_s=2.0,
        # On shutdown, scale-down or redeploy, requests in flight get as long as a single
        # server's drain gives them, and the engine then time to stop.
        graceful_shutdown_timeout_s=settings.serve_args["shutdown_timeout_s"]
        + ENGINE_STOP_MARGIN_S,
        ray_actor_options={"num_cpus": settings.replica_num_cpus,
                           "num_gpus": settings.replica_num_gpus},
    ).bind(dict(settings.serve_args))
    ingress = serve.deployment(Ingress).options(
        name="Ingress", num_replicas=1, max_ongoing_requests=100_000,
        # It relays the replicas' streams: it must outlive their drain (Ray Serve's default
        # of 20 s would cut off streams that the drain lets run longer).
        graceful_shutdown_timeout_s=settings.serve_args["shutdown_timeout_s"]
        + ENGINE_STOP_MARGIN_S,
        ray_actor_options={"num_cpus": 0},
    )
    return ingress.bind(replicas, settings.num_replicas, dict(settings.serve_args))


def stop_application(name: str, shutdown_timeout_s: float) -> None:
    """Stops the application `name` as SIGTERM stops a single server: every replica drains
    (503 for new generations; requests still running after `shutdown_timeout_s`, the
    replicas' `--shutdown-timeout-s`, end with an error), then the application is deleted."""
    logger.info("draining the replicas: requests in flight have %.1f s to finish",
                shutdown_timeout_s)
    try:
        drained = serve.get_app_handle(name).drain.remote().result(
            timeout_s=shutdown_timeout_s + 2 * ENGINE_STOP_MARGIN_S)
        logger.info("drained replicas %s", ", ".join(drained))
    except Exception as error:  # the application is deleted whatever went wrong
        logger.warning("could not drain the replicas (%s); deleting the application", error)
    serve.delete(name)


def app_builder(args: dict[str, Any]) -> serve.Application:
    """For `serve run engine.replicas.ray_app:app_builder KEY=VALUE ...` and Serve config
    files: `engine_args`, the flags of `continuum serve` as one shell-quoted string, including
    `--replicas N` and the other replica flags (e.g. `"--replicas 4 --device cuda --model
    DIR"`)."""
    parser = argparse.ArgumentParser(prog="continuum serve")
    add_arguments(parser)
    serve_args = parser.parse_args(shlex.split(str(args.get("engine_args", ""))))
    return build_application(settings_from_args(serve_args))


def settings_from_args(args: argparse.Namespace) -> ReplicaAppSettings:
    """The application of `continuum serve` flags (two replicas unless `--replicas` says);
    ValueError naming a bad one."""
    gpus = args.replica_gpus
    if gpus is None:
        gpus = 1.0 if args.device == "cuda" else 0.0
    return ReplicaAppSettings(
        serve_args=vars(args), num_replicas=2 if args.replicas is None else args.replicas,
        router=args.router,
        load_factor=args.route_load_factor, min_move_load=args.route_min_move_load,
        replica_num_cpus=args.replica_cpus, replica_num_gpus=gpus, seed=args.seed,
    )
