"""The OpenAI-compatible HTTP app: routes, authentication, request-size limit, lifespan.

`build_app` takes a factory for the engine, so that the engine (and its core process) starts
in the server's event loop when the app starts, and stops when it stops.
"""

from __future__ import annotations

import contextlib
import hmac
import importlib.metadata
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.core.client import EngineDeadError
from engine.entrypoints.openai.errors import (
    APIError,
    engine_dead_error,
    error_response,
    install_error_handlers,
)
from engine.entrypoints.openai.metrics import PrometheusMetrics
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

_UNAUTHENTICATED_PATHS = frozenset({"/health"})
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


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


def build_app(engine_factory: EngineFactory, settings: ServerSettings) -> FastAPI:
    """The app; the engine is created by `engine_factory` at start-up and shut down at exit."""
    metrics = PrometheusMetrics(settings.served_model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = engine_factory(metrics)
        app.state.engine = engine
        app.state.completions = OpenAIServingCompletion(engine, settings)
        app.state.chat = OpenAIServingChat(engine, settings)
        app.state.started_at = int(time.time())
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(title="Continuum engine", version=package_version(), lifespan=lifespan)
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


def _engine(request: Request) -> AsyncLLM:
    engine: AsyncLLM = request.app.state.engine
    if engine.is_dead:
        raise engine_dead_error()
    return engine


def _add_info_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health(request: Request) -> Response:
        """200 while the engine runs, 503 once its core has died."""
        if request.app.state.engine.is_dead:
            raise engine_dead_error()
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": package_version()}

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(request)]}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str, request: Request) -> dict[str, Any]:
        if model != request.app.state.settings.served_model_name:
            raise APIError(404, f"the model {model!r} does not exist", param="model",
                           code="model_not_found")
        return _model_card(request)

    @app.get("/metrics")
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
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        serving: OpenAIServingCompletion = request.app.state.completions
        response_id, requests = await serving.prepare(body, request.headers)
        if body.stream:
            return StreamingResponse(serving.stream(body, response_id, requests),
                                     media_type="text/event-stream", headers=_SSE_HEADERS)
        result = await _run(request, serving.create(body, response_id, requests))
        return JSONResponse(result)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        serving: OpenAIServingChat = request.app.state.chat
        prepared = await serving.prepare(body, request.headers)
        if body.stream:
            return StreamingResponse(serving.stream(body, prepared),
                                     media_type="text/event-stream", headers=_SSE_HEADERS)
        result = await _run(request, serving.create(body, prepared))
        return JSONResponse(result)


async def _run(request: Request, work: Any) -> dict[str, Any]:
    """A non-streaming generation: cancelled if the client goes; a request the core rejects
    is a 400."""
    try:
        return await cancel_on_disconnect(request, work)
    except ValueError as error:
        raise APIError(400, str(error)) from error


def _add_job_routes(app: FastAPI) -> None:
    @app.get("/v1/jobs/{job_id:path}")
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

    @app.delete("/v1/jobs/{job_id:path}")
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
