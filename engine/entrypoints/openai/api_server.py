"""The OpenAI-compatible HTTP app: routes, authentication, request-size limit, lifespan.

`build_app` takes a factory for the engine, so that the engine (and its core process) starts
in the server's event loop when the app starts, and stops when it stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import importlib.metadata
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.core.client import EngineDeadError
from engine.entrypoints.openai.errors import (
    APIError,
    engine_dead_error,
    error_response,
    install_error_handlers,
)
from engine.entrypoints.openai.metrics import PrometheusMetrics
from engine.entrypoints.openai.openapi import (
    SSE_RESPONSE,
    ChatCompletionResponse,
    CompletionResponse,
    JobDeleted,
    JobInfo,
    ModelCard,
    ModelList,
    VersionInfo,
    error_responses,
    openapi_document,
)
from engine.entrypoints.openai.protocol import (
    MAX_ID_CHARS,
    ChatCompletionRequest,
    CompletionRequest,
)
from engine.entrypoints.openai.serving import ServerSettings, cancel_on_disconnect
from engine.entrypoints.openai.serving_chat import OpenAIServingChat
from engine.entrypoints.openai.serving_completions import OpenAIServingCompletion
from engine.frontend.async_llm import AsyncLLM
from engine.frontend.stats import RequestStatsObserver

EngineFactory = Callable[[RequestStatsObserver], AsyncLLM]

ENGINE_WATCH_INTERVAL_S = 0.25
_UNAUTHENTICATED_PATHS = frozenset({"/health"})
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

logger = logging.getLogger(__name__)


def package_version() -> str:
    try:
        return importlib.metadata.version("continuum-engine")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class BearerAuthMiddleware:
    """Requires `Authorization: Bearer <api_key>` on every path but `/health`."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in _UNAUTHENTICATED_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = error_response(401, "a valid API key is required (Authorization: "
                                          "Bearer <key>)", code="invalid_api_key",
                                          headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """Answers 413 to a request body over `max_bytes`, by its Content-Length or, for chunked
    bodies, as soon as the bytes read exceed it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            try:
                too_large = int(declared) > self.max_bytes
            except ValueError:
                await error_response(400, "invalid Content-Length")(scope, receive, send)
                return
            if too_large:
                await self._too_large()(scope, receive, send)
                return
        num_read = 0

        async def limited_receive() -> Message:
            nonlocal num_read
            message = await receive()
            if message["type"] == "http.request":
                num_read += len(message.get("body", b""))
                if num_read > self.max_bytes:
                    raise self._too_large_error()
            return message

        await self.app(scope, limited_receive, send)

    def _too_large_error(self) -> APIError:
        return APIError(413, f"the request body exceeds {self.max_bytes} bytes",
                        code="request_too_large")

    def _too_large(self) -> JSONResponse:
        error = self._too_large_error()
        return error_response(413, error.message, code=error.code)


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
        app.state.engine = engine
        app.state.completions = OpenAIServingCompletion(engine, settings)
        app.state.chat = OpenAIServingChat(engine, settings)
        app.state.started_at = int(time.time())
        watcher = None if on_engine_dead is None else asyncio.ensure_future(
            _call_when_dead(engine, on_engine_dead))
        try:
            yield
        finally:
            if watcher is not None:
                watcher.cancel()
            engine.shutdown()

    app = FastAPI(title="Continuum engine", version=package_version(), lifespan=lifespan)
    app.openapi = lambda: _openapi(app, settings)  # type: ignore[method-assign]
    app.state.settings = settings
    app.state.metrics = metrics
    install_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_request_body_bytes)
    if settings.api_key is not None:
        app.add_middleware(BearerAuthMiddleware, api_key=settings.api_key)
    _add_info_routes(app)
    _add_generation_routes(app)
    _add_job_routes(app)
    return app


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


def _add_info_routes(app: FastAPI) -> None:
    @app.get("/health", operation_id="health", response_class=Response,
             responses={200: {"description": "The engine runs.", "content": {}},
                        **error_responses(503)})
    async def health(request: Request) -> Response:
        """200 while the engine runs, 503 once its core has died."""
        if request.app.state.engine.is_dead:
            raise engine_dead_error()
        return Response(status_code=200)

    @app.get("/version", operation_id="version", response_model=VersionInfo)
    async def version() -> dict[str, str]:
        return {"version": package_version()}

    @app.get("/v1/models", operation_id="listModels", response_model=ModelList)
    async def list_models(request: Request) -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(request)]}

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
    return {"id": state.settings.served_model_name, "object": "model",
            "created": state.started_at, "owned_by": "continuum",
            "root": config.model.model, "max_model_len": config.scheduler.max_model_len}


def _add_generation_routes(app: FastAPI) -> None:
    @app.post("/v1/completions", operation_id="createCompletion", response_class=JSONResponse,
              responses=_generation_responses(CompletionResponse))
    async def completions(body: CompletionRequest, request: Request) -> Response:
        serving: OpenAIServingCompletion = request.app.state.completions
        response_id, requests = await serving.prepare(body, request.headers)
        if body.stream:
            return StreamingResponse(serving.stream(body, response_id, requests),
                                     media_type="text/event-stream", headers=_SSE_HEADERS)
        result = await _run(request, serving.create(body, response_id, requests))
        return JSONResponse(result)

    @app.post("/v1/chat/completions", operation_id="createChatCompletion",
              response_class=JSONResponse,
              responses=_generation_responses(ChatCompletionResponse))
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        serving: OpenAIServingChat = request.app.state.chat
        prepared = await serving.prepare(body, request.headers)
        if body.stream:
            return StreamingResponse(serving.stream(body, prepared),
                                     media_type="text/event-stream", headers=_SSE_HEADERS)
        result = await _run(request, serving.create(body, prepared))
        return JSONResponse(result)


def _generation_responses(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    return {200: {"model": model, "description": "The completion (JSON), or its stream (SSE).",
                  "content": SSE_RESPONSE},
            **error_responses(400, 404, 413, 429, 503)}


async def _run(request: Request, work: Any) -> dict[str, Any]:
    """A non-streaming generation: cancelled if the client goes; a request the core rejects
    is a 400."""
    try:
        return await cancel_on_disconnect(request, work)
    except ValueError as error:
        raise APIError(400, str(error)) from error


def _add_job_routes(app: FastAPI) -> None:
    @app.get("/v1/jobs/{job_id:path}", operation_id="retrieveJob", response_model=JobInfo,
             responses=error_responses(400, 404, 503))
    async def get_job(job_id: str, request: Request) -> dict[str, Any]:
        """What the engine holds for the job: unfinished turns, its KV pin, and the
        scheduling policy's books (turns, pins by release reason, last TTL)."""
        state = await _engine(request).job_state(_check_job_id(job_id))
        if state is None:
            raise _unknown_job(job_id)
        return {"id": job_id, "object": "job",
                "num_unfinished_requests": state.num_unfinished_requests,
                "pin": None if state.pin is None else {
                    "request_id": state.pin.request_id, "num_blocks": state.pin.num_blocks,
                    "ttl_s": state.pin.ttl_s, "remaining_ttl_s": state.pin.remaining_ttl_s},
                "policy": None if state.policy is None else msgspec.to_builtins(state.policy)}

    @app.delete("/v1/jobs/{job_id:path}", operation_id="deleteJob", response_model=JobDeleted,
                responses=error_responses(400, 404, 503))
    async def delete_job(job_id: str, request: Request) -> dict[str, Any]:
        """Ends the job's state in the engine, releasing its KV pin."""
        engine = _engine(request)
        if await engine.job_state(_check_job_id(job_id)) is None:
            raise _unknown_job(job_id)
        released = await engine.release_job(job_id)
        return {"id": job_id, "object": "job", "deleted": True, "released_pin": released}


def _check_job_id(job_id: str) -> str:
    if not job_id or len(job_id) > MAX_ID_CHARS:
        raise APIError(400, f"job_id must hold 1 to {MAX_ID_CHARS} characters", param="job_id")
    return job_id


def _unknown_job(job_id: str) -> APIError:
    return APIError(404, f"the engine holds nothing for job {job_id!r} (no pin, no "
                         "unfinished turn, no policy state)", param="job_id", code="job_not_found")
