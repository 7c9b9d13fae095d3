"""The OpenAI-compatible HTTP app: routes, authentication, request-size limit, lifespan.

`build_app` takes a factory for the engine, so that the engine (and its core process) starts
in the server's event loop when the app starts, and stops when it stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import importlib.metadata
import logging
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal

import msgspec
from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.background import BackgroundTask
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.core.client import EngineDeadError
from engine.entrypoints.openai.anthropic_errors import AnthropicErrorsMiddleware, is_messages_path
from engine.entrypoints.openai.body_budget import (
    BodyByteBudget,
    BodyRefused,
    parse_content_length,
)
from engine.entrypoints.openai.drain import Drain, ServerShuttingDownError
from engine.entrypoints.openai.errors import (
    APIError,
    api_error_response,
    engine_dead_error,
    error_response,
    install_error_handlers,
    invalid_api_key_response,
    shutting_down_error,
)
from engine.entrypoints.openai.json_body import BodyParser, PoolParsedRoute
from engine.entrypoints.openai.metrics import PrometheusMetrics
from engine.entrypoints.openai.openapi import (
    RESPONSE_EVENTS,
    SSE_RESPONSE,
    ChatCompletionResponse,
    CompletionResponse,
    JobDeleted,
    JobInfo,
    ModelCard,
    ModelList,
    ResponseDeleted,
    ResponseObject,
    VersionInfo,
    error_responses,
    openapi_document,
)
from engine.entrypoints.openai.protocol import (
    MAX_ID_CHARS,
    ChatCompletionRequest,
    CompletionRequest,
)
from engine.entrypoints.openai.protocol_messages import (
    MessagesCountTokensRequest,
    MessagesRequest,
)
from engine.entrypoints.openai.protocol_responses import ResponsesRequest
from engine.entrypoints.openai.refusal_pacing import RefusalPacer, peer_closed_check
from engine.entrypoints.openai.request_id import RequestIdMiddleware
from engine.entrypoints.openai.response_store import ResponseStore
from engine.entrypoints.openai.serving import (
    BodyT,
    ClientContext,
    OpenAIServing,
    PreparedT,
    ServerSettings,
    cancel_on_disconnect,
    rejected_param,
)
from engine.entrypoints.openai.serving_chat import OpenAIServingChat
from engine.entrypoints.openai.serving_completions import OpenAIServingCompletion
from engine.entrypoints.openai.serving_messages import OpenAIServingMessages
from engine.entrypoints.openai.serving_responses import OpenAIServingResponses
from engine.entrypoints.openai.stored_responses import StoredResponses
from engine.entrypoints.openai.structured_outputs import GrammarChecker
from engine.entrypoints.openai.tenants import (
    TENANT_SCOPE_KEY,
    UNAUTHENTICATED_PATHS,
    Tenants,
    engine_job_id,
    scope_tenant,
)
from engine.frontend.async_llm import AsyncLLM
from engine.frontend.processor import ProcessedRequest
from engine.frontend.stats import RequestStatsObserver

EngineFactory = Callable[[RequestStatsObserver], AsyncLLM]

ENGINE_WATCH_INTERVAL_S = 0.25
# Names the job a generation ran in (`_generate`).
JOB_ID_HEADER = "x-continuum-job-id"
# What a job id keeps as it is in `JOB_ID_HEADER`: printable ASCII but the space and `%`.
_HEADER_SAFE = "".join(chr(code) for code in range(0x21, 0x7F) if chr(code) != "%")
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# On answers sent before the body was read: the connection closes rather than wait for a
# body nobody will read.
_CLOSE = {"Connection": "close"}

logger = logging.getLogger(__name__)


def package_version() -> str:
    try:
        return importlib.metadata.version("continuum-engine")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class BearerAuthMiddleware:
    """Requires `Authorization: Bearer <key>` (or `x-api-key: <key>`) with a key of `tenants`
    on every path but `/health`, and records the key's tenant in the request's scope."""

    def __init__(self, app: ASGIApp, tenants: Tenants) -> None:
        self.app = app
        self.tenants = tenants

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in UNAUTHENTICATED_PATHS:
            tenant = self.tenants.tenant_of_request(scope)
            if tenant is None:
                await invalid_api_key_response()(scope, receive, send)
                return
            scope[TENANT_SCOPE_KEY] = tenant
        await self.app(scope, receive, send)


class BodyLimitsMiddleware:
    """Answers 413 to a request body over `max_bytes`, by its Content-Length or, for chunked
    bodies, as soon as the bytes read exceed it. The bytes read are held in `budget` for the
    request's tenant until the response has ended; a body whose Content-Length does not fit
    in what the budget has free gets its 429 or 503 before any of it is read, and one that
    stops fitting as it arrives gets it then, unless younger bodies still arriving give
    their room back (and get it instead, at once). A refusal before any of the body is read
    is answered when `pacer` says (late to a tenant that did not wait out its previous
    one); one midway is answered at once, since holding it would hold what was read."""

    def __init__(self, app: ASGIApp, max_bytes: int, budget: BodyByteBudget,
                 pacer: RefusalPacer) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.budget = budget
        self.pacer = pacer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        reservation = self.budget.reservation(scope_tenant(scope))
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            num_bytes_declared = parse_content_length(declared)
            if num_bytes_declared is None:
                await error_response(400, "invalid Content-Length")(scope, receive, send)
                return
            if num_bytes_declared > self.max_bytes:
                await api_error_response(self._too_large_error())(scope, receive, send)
                return
            try:
                reservation.check_declared(num_bytes_declared)
            except BodyRefused as refusal:
                await self.pacer.pace(reservation.tenant, peer_closed_check(scope))
                await api_error_response(refusal)(scope, receive, send)
                return
        num_bytes_read = 0

        async def limited_receive() -> Message:
            nonlocal num_bytes_read
            message = await reservation.unless_revoked(receive)
            if message["type"] == "http.request":
                num_bytes_read += len(message.get("body", b""))
                if num_bytes_read > self.max_bytes:
                    reservation.stop_arriving()
                    raise self._too_large_error()
                reservation.cover(num_bytes_read, complete=not message.get("more_body"))
            return message

        try:
            await self.app(scope, limited_receive, send)
        finally:
            reservation.release()

    def _too_large_error(self) -> APIError:
        return APIError(413, f"the request body exceeds {self.max_bytes} bytes",
                        code="request_too_large", headers=_CLOSE)


def build_app(
    engine_factory: EngineFactory, settings: ServerSettings,
    on_engine_dead: Callable[[], None] | None = None,
) -> FastAPI:
    """The app; the engine is created by `engine_factory` at start-up and shut down at exit.

    Once the engine's core dies, every generation answers 503 and `/health` fails; within
    `ENGINE_WATCH_INTERVAL_S`, `on_engine_dead` is called (the server then exits, for its
    supervisor to restart it).
    """
    metrics = PrometheusMetrics(settings.served_model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = engine_factory(metrics)
        pool = settings.work_pool()
        app.state.engine = engine
        app.state.work_pool = pool
        app.state.body_parser = parser = BodyParser(
            pool.num_background_threads, engine.processor, settings.large_body_cpu)
        grammar_checker = _prepared_grammar_checker(engine)
        await engine.prepare_grammars()
        shared = (engine, settings, pool, grammar_checker, app.state.refusal_pacer)
        app.state.completions = OpenAIServingCompletion(*shared)
        app.state.chat = OpenAIServingChat(*shared)
        app.state.messages = OpenAIServingMessages(*shared)
        store = ResponseStore(
            max_responses=settings.max_stored_responses,
            max_bytes=settings.max_stored_response_bytes, num_tenants=settings.num_tenants)
        app.state.responses = OpenAIServingResponses(*shared, store)
        app.state.stored_responses = StoredResponses(store, pool)
        app.state.started_at = int(time.time())
        watcher = None if on_engine_dead is None else asyncio.ensure_future(
            _call_when_dead(engine, on_engine_dead))
        try:
            yield
        finally:
            if watcher is not None:
                watcher.cancel()
            app.state.drain.cancel()
            engine.shutdown()
            pool.shutdown()
            parser.shutdown()

    app = FastAPI(title="Continuum engine", version=package_version(), lifespan=lifespan)
    app.router.route_class = PoolParsedRoute
    app.openapi = lambda: _openapi(app, settings)  # type: ignore[method-assign]
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.drain = Drain(settings.shutdown_timeout_s)
    install_error_handlers(app)
    app.state.body_budget = settings.body_budget()
    app.state.refusal_pacer = settings.refusal_pacer()
    metrics.track_body_budget(app.state.body_budget, app.state.refusal_pacer)
    app.add_middleware(BodyLimitsMiddleware, max_bytes=settings.max_request_body_bytes,
                       budget=app.state.body_budget, pacer=app.state.refusal_pacer)
    if settings.tenants is not None:
        app.add_middleware(BearerAuthMiddleware, tenants=settings.tenants)
    app.add_middleware(AnthropicErrorsMiddleware)  # its paths' refusals in Anthropic's shape
    # Outermost: its header is on every response.
    app.add_middleware(RequestIdMiddleware, anthropic_paths=is_messages_path)
    _add_info_routes(app)
    _add_generation_routes(app)
    _add_response_routes(app)
    _add_messages_routes(app)
    _add_job_routes(app)
    return app


def begin_drain(app: FastAPI) -> None:
    """Starts the app's graceful drain (the server stopped accepting connections): new
    generations get 503, and requests still running after `shutdown_timeout_s` end with an
    error. Called from the server's event loop."""
    app.state.drain.begin(getattr(app.state, "engine", None))


def _prepared_grammar_checker(engine: AsyncLLM) -> GrammarChecker:
    """The endpoints' grammar checker, its tokenizer built before the server takes requests
    (a failure is logged: constrained requests then fail when they are checked)."""
    checker = GrammarChecker(engine.processor.tokenizer)
    try:
        checker.prepare()
    except Exception as error:  # a tokenizer llguidance cannot read
        logger.warning("structured outputs cannot be checked: %s", error)
    return checker


async def _call_when_dead(engine: AsyncLLM, on_engine_dead: Callable[[], None]) -> None:
    while not engine.is_dead:
        await asyncio.sleep(ENGINE_WATCH_INTERVAL_S)
    logger.error("the engine core died; the server stops (restart it to serve again)")
    on_engine_dead()


def _openapi(app: FastAPI, settings: ServerSettings) -> dict[str, Any]:
    if app.openapi_schema is None:
        config = app.state.engine.config
        app.openapi_schema = openapi_document(
            app, settings, max_model_len=config.scheduler.max_model_len,
            vocab_size=app.state.engine.processor.vocab_size)
    return app.openapi_schema


def _engine(request: Request) -> AsyncLLM:
    engine: AsyncLLM = request.app.state.engine
    if engine.is_dead:
        raise engine_dead_error()
    return engine


def _check_accepting(request: Request) -> None:
    if request.app.state.drain.draining:
        raise shutting_down_error()


def _add_info_routes(app: FastAPI) -> None:
    @app.get("/health", operation_id="health", response_class=Response,
             responses={200: {"description": "The engine runs.", "content": {}},
                        **error_responses(503)})
    async def health(request: Request) -> Response:
        """200 while the engine runs, 503 once its core has died."""
        if request.app.state.engine.is_dead:
            raise engine_dead_error()
        return Response(status_code=200)

    # The same for load balancers' HEAD probes.
    app.head("/health", include_in_schema=False)(health)

    @app.get("/version", operation_id="version", response_model=VersionInfo)
    async def version() -> dict[str, str]:
        return {"version": package_version()}

    @app.get("/v1/models", operation_id="listModels", response_model=ModelList)
    async def list_models(request: Request) -> dict[str, Any]:
        name = request.app.state.settings.served_model_name
        return {"object": "list", "data": [_model_card(request)], "has_more": False,
                "first_id": name, "last_id": name}

    @app.get("/v1/models/{model:path}", operation_id="retrieveModel",
             response_model=ModelCard, responses=error_responses(404))
    async def retrieve_model(model: str, request: Request) -> dict[str, Any]:
        if model != request.app.state.settings.served_model_name:
            raise APIError(404, f"the model {model!r} does not exist", param="model",
                           code="model_not_found")
        return _model_card(request)

    @app.get("/metrics", operation_id="metrics", response_class=Response, responses={200: {
        "description": "Prometheus metrics (text exposition format).",
        "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def prometheus_metrics(request: Request) -> Response:
        engine: AsyncLLM = request.app.state.engine
        metrics: PrometheusMetrics = request.app.state.metrics
        if not engine.is_dead:
            with contextlib.suppress(EngineDeadError):  # frontend metrics are still useful
                metrics.update_core_stats(await engine.get_stats())
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _model_card(request: Request) -> dict[str, Any]:
    state = request.app.state
    config = state.engine.config
    name = state.settings.served_model_name
    created_at = datetime.datetime.fromtimestamp(state.started_at, datetime.UTC)
    return {"id": name, "object": "model", "created": state.started_at, "owned_by": "continuum",
            "root": config.model.model, "max_model_len": config.scheduler.max_model_len,
            "type": "model", "display_name": name,
            "created_at": created_at.isoformat().replace("+00:00", "Z")}


def _add_generation_routes(app: FastAPI) -> None:
    @app.post("/v1/completions", operation_id="createCompletion", response_class=JSONResponse,
              responses=_generation_responses(CompletionResponse))
    async def completions(body: CompletionRequest, request: Request) -> Response:
        serving: OpenAIServingCompletion = request.app.state.completions
        return await _generate(request, serving, body)

    @app.post("/v1/chat/completions", operation_id="createChatCompletion",
              response_class=JSONResponse,
              responses=_generation_responses(ChatCompletionResponse))
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        serving: OpenAIServingChat = request.app.state.chat
        return await _generate(request, serving, body)


def _add_response_routes(app: FastAPI) -> None:
    @app.post("/v1/responses", operation_id="createResponse", response_class=JSONResponse,
              responses={**_generation_responses(ResponseObject),
                         200: {"model": ResponseObject, "content": RESPONSE_EVENTS,
                               "description": "The response (JSON), or its events (SSE)."}})
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        """OpenAI's Responses API: input items (or a string), function tools, streaming as
        semantic events; stored responses are continued with previous_response_id, as turns
        of one job."""
        serving: OpenAIServingResponses = request.app.state.responses
        return await _generate(request, serving, body)

    @app.get("/v1/responses/{response_id}", operation_id="retrieveResponse",
             response_class=JSONResponse,
             responses={200: {"model": ResponseObject, "description": "The stored response."},
                        **error_responses(400, 404)})
    async def retrieve_response(response_id: str, request: Request,
                                stream: bool = False) -> Response:
        """A stored response of the requesting tenant; `stream` (a background response's
        events) is refused, as no response runs in the background here."""
        if stream:
            raise APIError(400, "stream replays a background response's events, and this "
                                "server runs none in the background; retrieve the response "
                                "without it", param="stream")
        stored: StoredResponses = request.app.state.stored_responses
        return await stored.retrieve(response_id, scope_tenant(request.scope))

    @app.get("/v1/responses/{response_id}/input_items", operation_id="listInputItems",
             response_class=JSONResponse, responses={
                 200: {"description": "The response's input items, as OpenAI lists them."},
                 **error_responses(400, 404)})
    async def list_input_items(
            response_id: str, request: Request,
            limit: Annotated[int, Query(ge=1, le=100)] = 20,
            order: Literal["asc", "desc"] = "desc", after: str | None = None) -> Response:
        """The input items of a stored response of the requesting tenant."""
        stored: StoredResponses = request.app.state.stored_responses
        page = await stored.input_items(response_id, scope_tenant(request.scope),
                                         limit=limit, order=order, after=after)
        return JSONResponse(page)

    @app.post("/v1/responses/{response_id}/cancel", operation_id="cancelResponse",
              response_class=JSONResponse, responses=error_responses(400, 404))
    async def cancel_response(response_id: str, request: Request) -> Response:
        """Refused: only background responses can be cancelled, and none runs here."""
        stored: StoredResponses = request.app.state.stored_responses
        return JSONResponse(stored.cancel(response_id, scope_tenant(request.scope)))

    @app.delete("/v1/responses/{response_id}", operation_id="deleteResponse",
                response_model=ResponseDeleted, responses=error_responses(404))
    async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
        """Forgets a stored response: later requests can no longer continue it."""
        stored: StoredResponses = request.app.state.stored_responses
        return stored.delete(response_id, scope_tenant(request.scope))


def _add_messages_routes(app: FastAPI) -> None:
    # Left out of the OpenAPI document, whose error bodies are OpenAI's.
    @app.post("/v1/messages", operation_id="createMessage", response_class=JSONResponse,
              include_in_schema=False)
    async def create_message(body: MessagesRequest, request: Request) -> Response:
        """Anthropic's Messages API: the next assistant message, whole or as its events."""
        serving: OpenAIServingMessages = request.app.state.messages
        return await _generate(request, serving, body)

    @app.post("/v1/messages/count_tokens", operation_id="countMessageTokens",
              response_class=JSONResponse, include_in_schema=False)
    async def count_message_tokens(body: MessagesCountTokensRequest,
                                   request: Request) -> dict[str, int]:
        """The input tokens the same Messages request would take."""
        serving: OpenAIServingMessages = request.app.state.messages
        return await serving.count_tokens(body, ClientContext.of(request))


def _generation_responses(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    return {200: {"model": model, "description": "The completion (JSON), or its stream (SSE).",
                  "content": SSE_RESPONSE},
            **error_responses(400, 404, 413, 429, 503)}


async def _generate(request: Request, serving: OpenAIServing[BodyT, PreparedT], body: BodyT
                    ) -> Response:
    """A generation's response, by the API's handler: its SSE stream when `body.stream`, else
    its JSON (as the handler encoded it, or from the object it returned); either way the
    engine requests are aborted once the client is gone or served. Its `x-continuum-job-id`
    header names the job the engine ran it in (the client's, or the one it inferred), known at
    its first token: a stream starts then (aborted if its client leaves before)."""
    _check_accepting(request)
    prepared = await serving.prepare(body, ClientContext.of(request))
    engine_requests = prepared.requests
    cleanup = BackgroundTask(serving.abort, engine_requests)
    job = _engine(request).job_of(engine_requests[0].request_id)
    if body.stream:
        try:  # a client gone before the first token leaves nothing running
            job_id = await cancel_on_disconnect(request, asyncio.shield(job))
        except APIError:
            await cleanup()
            raise
        headers = {**_SSE_HEADERS, **_job_header(request, job_id)}
        return StreamingResponse(
            _aborting_when_done(serving.stream(body, prepared), serving, engine_requests),
            background=cleanup, media_type="text/event-stream", headers=headers)
    created = await _run(request, serving.create(body, prepared), cleanup)
    response = created if isinstance(created, Response) else JSONResponse(created)
    response.headers.update(_job_header(request, job.result() if job.done() else None))
    return response


def _job_header(request: Request, job_id: str | None) -> dict[str, str]:
    """The header naming a response's job, as its client names it (without its tenant's
    name: `GET /v1/jobs/{id}` takes it as it is), percent-encoded (UTF-8) where it is not
    printable ASCII, since a header carries no other text; none without a job."""
    if job_id is None:
        return {}
    tenant = scope_tenant(request.scope)
    if tenant is not None:
        job_id = job_id.removeprefix(f"{tenant}/")
    return {JOB_ID_HEADER: urllib.parse.quote(job_id, safe=_HEADER_SAFE)}


async def _aborting_when_done(chunks: AsyncIterator[bytes], serving: OpenAIServing[Any, Any],
                              engine_requests: list[ProcessedRequest]) -> AsyncIterator[bytes]:
    """The stream's chunks; however it ends (an error, a client gone), its engine requests
    are aborted. The background cleanup alone misses a stream that raises, which a stream
    that had not yet read its engine output would not abort either."""
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        serving.abort_nowait(engine_requests)


async def _run(request: Request, work: Awaitable[dict[str, Any] | Response],
               cleanup: BackgroundTask) -> dict[str, Any] | Response:
    """A non-streaming generation: cancelled if the client goes (`cleanup` then aborts what
    the engine still runs of it); a request the core rejects is a 400."""
    try:
        return await cancel_on_disconnect(request, work)
    except ValueError as error:
        raise APIError(400, str(error), param=rejected_param(error)) from error
    except ServerShuttingDownError as error:
        raise shutting_down_error(error) from error
    finally:
        await cleanup()


def _add_job_routes(app: FastAPI) -> None:
    @app.get("/v1/jobs/{job_id:path}", operation_id="retrieveJob", response_model=JobInfo,
             responses=error_responses(400, 404, 503))
    async def get_job(job_id: str, request: Request) -> dict[str, Any]:
        """What the engine holds for the job: unfinished turns, its KV pin, and the
        scheduling policy's books (turns, pins by release reason, last TTL)."""
        state = await _engine(request).job_state(_tenant_job_id(request, job_id))
        if state is None:
            raise _unknown_job(job_id)
        return {"id": job_id, "object": "job",
                "num_unfinished_requests": state.num_unfinished_requests,
                "pin": None if state.pin is None else {
                    "request_id": state.pin.request_id, "num_blocks": state.pin.num_blocks,
                    "ttl_s": state.pin.ttl_s, "remaining_ttl_s": state.pin.remaining_ttl_s,
                    "source": state.pin.source},
                "policy": None if state.policy is None else msgspec.to_builtins(state.policy)}

    @app.delete("/v1/jobs/{job_id:path}", operation_id="deleteJob", response_model=JobDeleted,
                responses=error_responses(400, 404, 503))
    async def delete_job(job_id: str, request: Request) -> dict[str, Any]:
        """Ends the job's state in the engine, releasing its KV pin."""
        engine = _engine(request)
        engine_id = _tenant_job_id(request, job_id)
        if await engine.job_state(engine_id) is None:
            raise _unknown_job(job_id)
        released = await engine.release_job(engine_id)
        return {"id": job_id, "object": "job", "deleted": True, "released_pin": released}


def _tenant_job_id(request: Request, job_id: str) -> str:
    """The engine's id of the requesting tenant's job `job_id` (another tenant's job of the
    same name is a different job)."""
    if not job_id or len(job_id) > MAX_ID_CHARS:
        raise APIError(400, f"job_id must hold 1 to {MAX_ID_CHARS} characters", param="job_id")
    return engine_job_id(scope_tenant(request.scope), job_id)


def _unknown_job(job_id: str) -> APIError:
    return APIError(404, f"the engine holds nothing for job {job_id!r} (no pin, no "
                         "unfinished turn, no policy state)", param="job_id", code="job_not_found")
