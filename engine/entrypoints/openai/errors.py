"""Errors in OpenAI's format: `{"error": {"message", "type", "param", "code"}}` with the
matching HTTP status, for every failure the server reports (its own and the framework's)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from engine.core.client import EngineDeadError
from engine.entrypoints.openai.anthropic_errors import anthropic_error_body, is_messages_path
from engine.entrypoints.openai.request_id import REQUEST_ID_HEADER, request_id_headers

logger = logging.getLogger(__name__)

def error_type(status: int) -> str:
    """OpenAI's error type for a status: client errors are invalid requests (the `code`
    says which), except rate limits; everything else is a server error."""
    if status == 429:
        return "rate_limit_error"
    return "invalid_request_error" if status < 500 else "server_error"


class APIError(HTTPException):
    """An error to answer with `status` and an OpenAI error body.

    A subclass of FastAPI's HTTPException, so that it passes unchanged through FastAPI's body
    parsing (the request-size limit raises it while the body is read).
    """

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(status_code=status, detail=message, headers=headers)
        self.message = message
        self.param = param
        self.code = code


def check_unique_names(names: Iterable[str], param: str) -> None:
    """APIError(400) naming every name of `names` given more than once (in linear time: a
    body may list thousands)."""
    duplicates = sorted(name for name, count in Counter(names).items() if count > 1)
    if duplicates:
        raise APIError(400, f"{param} name {', '.join(map(repr, duplicates))} more than once",
                       param=param)


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type(status), "param": param,
                      "code": code}}


def error_response(
    status: int, message: str, *, param: str | None = None, code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param=param, code=code), status_code=status,
                        headers=headers)


def api_error_response(error: APIError) -> JSONResponse:
    """The response that answers `error` (with its headers)."""
    return error_response(error.status_code, error.message, param=error.param, code=error.code,
                          headers=error.headers)


def invalid_api_key_response() -> JSONResponse:
    """The 401 for a request without a valid API key; the connection closes rather than
    wait for a body nobody will read."""
    return error_response(401, "a valid API key is required (Authorization: Bearer <key>, "
                               "or x-api-key: <key>)",
                          code="invalid_api_key",
                          headers={"WWW-Authenticate": "Bearer", "Connection": "close"})


def engine_dead_error(error: BaseException | None = None) -> APIError:
    # The core's message may end in its traceback: clients get the first line only.
    detail = f": {str(error).splitlines()[0]}" if error is not None and str(error) else ""
    return APIError(503, f"the engine is not running{detail}", code="engine_dead")


def shutting_down_error(error: BaseException | None = None) -> APIError:
    """503 for a request refused or ended by the server's drain (`error` says why)."""
    message = str(error) if error is not None and str(error) else "the server is shutting down"
    return APIError(503, message, code="server_shutting_down")


# How pydantic names the members of a union in an error's location (e.g. `prompt.str`).
_UNION_MEMBER_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict"})


def _names_a_field(part: str | int) -> bool:
    """Whether a part of a validation error's location is a field or an index (not where
    the field is, `body`, `query` or `path`, nor a union member's tag such as
    `constrained-str` or `list[int]`)."""
    if isinstance(part, int):
        return True
    return part.isidentifier() and part not in ("body", "query", "path") and \
        part not in _UNION_MEMBER_TAGS


def validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    """A readable message for the first validation error, and the parameter it concerns."""
    errors = error.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    location = [str(part) for part in first.get("loc", ()) if _names_a_field(part)]
    param = ".".join(location) or None
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('msg')}", None
    message = first.get("msg", "invalid value")
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return (f"{param}: {message}" if param else message) + more, param


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at this path (Starlette names only the first route's,
    and the job endpoints are two routes)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches(request.scope)
        if match != Match.NONE:
            methods.update(getattr(route, "methods", None) or ())
    return sorted(methods)


def install_error_handlers(app: FastAPI) -> None:
    """Every error the app can raise becomes an OpenAI error body."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        return api_error_response(error)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        headers = error.headers
        message = str(error.detail)
        route = f"{request.method} {request.url.path}"
        if error.status_code == 404 and message == "Not Found":  # no such route, as OpenAI says
            message = f"Invalid URL ({route})"
        if error.status_code == 405:
            allowed = ", ".join(_allowed_methods(request))
            headers = {**(headers or {}), "Allow": allowed}
            message = f"Method not allowed ({route}); allowed: {allowed}"
        return error_response(error.status_code, message, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        message, param = validation_message(error)
        return error_response(400, message, param=param)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, error: EngineDeadError) -> JSONResponse:
        dead = engine_dead_error(error)
        return error_response(dead.status_code, dead.message, code=dead.code)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, error: Exception) -> JSONResponse:
        # Starlette answers this one from outside every middleware: the request id header
        # is added here.
        headers = request_id_headers(request.scope)
        logger.exception("unhandled error in %s %s (request id %s)", request.method,
                         request.url.path, headers.get(REQUEST_ID_HEADER))
        message = f"internal server error: {type(error).__name__}"
        if is_messages_path(request.url.path):  # outside the middleware that rewrites errors
            return JSONResponse(anthropic_error_body(500, message,
                                                     headers.get(REQUEST_ID_HEADER)),
                                status_code=500, headers=headers)
        return error_response(500, message, headers=headers)
