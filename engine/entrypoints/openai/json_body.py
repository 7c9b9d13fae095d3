"""Request bodies parsed without holding the event loop.

CPython's JSON parser holds the GIL for the whole parse (0.2 s for 15 MB of small items), and
a parse in pure Python on a thread is worse: its threads take the GIL from the event loop
every few milliseconds, each time the loop wakes up (one victim's inter-token p99 went from
17 ms to 2.9 s). So a body over `INLINE_PARSE_BYTES` is parsed in a child process
(`BodyParser`), which also checks the counts of `body_limits`: a body over them never comes
back into the server's process. One within them is validated there as the route's body
model and comes back as the model's instance, which the route's validation then takes as it
is: FastAPI's validation holds the GIL in one piece on the event loop (an 8 MB chat of 2,000
messages: 20-36 ms; 10,000 Responses items: about 110 ms), while loading the instance's
pickle runs on the parser's result thread in Python that yields the GIL (5 ms; 10,000
items: about 90 ms, several times slower than loading the parsed JSON). A body that
does not validate comes back as parsed, for the route to report its error. A chat request's
conversation is also rendered and tokenized there (`chat_prompt`), when the parser has the
engine's input processor, for the same reason. The child is asked from the server's
`TenantWorkPool`, in the tenant's turn, and runs in Linux's idle scheduling class; the rest of
such a request's preparation runs at low CPU priority too (`ClientContext.large_body`).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.types import Receive, Scope

from engine.entrypoints.openai.body_limits import BodyLimitError, parse_validated
from engine.entrypoints.openai.chat_prompt import prepared_chat_prompt
from engine.entrypoints.openai.errors import APIError
from engine.entrypoints.openai.tenants import scope_tenant
from engine.entrypoints.openai.work_pool import BACKGROUND_NICENESS, TenantWorkPool
from engine.frontend.processor import InputProcessor

INLINE_PARSE_BYTES = 64 * 1024
# The request scope's state key that says the body was over `INLINE_PARSE_BYTES`: the rest of
# its preparation runs in the work pool's background (`ClientContext.large_body`).
LARGE_BODY_STATE = "continuum_large_body"
# The scope's state key of a large chat body's `ChatPrompt`, made with the body in the child
# (`ClientContext.chat_prompt`), on the routes of `CHAT_PROMPT_PATHS`.
CHAT_PROMPT_STATE = "continuum_chat_prompt"
CHAT_PROMPT_PATHS = frozenset({"/v1/chat/completions"})
DEFAULT_PARSER_PROCESSES = 2
# The body field that holds the conversation, by path (see `body_limits.check_counts`).
CONVERSATION_FIELDS = {"/v1/chat/completions": "messages", "/v1/responses": "input"}


@dataclass(frozen=True)
class ParsedBody:
    """A body parsed in the child: `value`, as `body_limits.parse_validated` returns it, and
    what the parser's `prepare` made of it (None when it did not run)."""

    value: Any
    prepared: Any = None


Prepare = Callable[[InputProcessor, Any], Any]


class BodyParser:
    """Parses large bodies in `num_processes` child processes (spawned at the first large
    body; a pool broken by a child's death is replaced at the next), each holding a copy of
    `processor` (the engine's input processor, for `parse`'s `prepare`; None: nothing is
    prepared). Owned by the server: `parse` is called from its work pool's threads,
    `shutdown` once at exit."""

    def __init__(self, num_processes: int = DEFAULT_PARSER_PROCESSES,
                 processor: InputProcessor | None = None) -> None:
        if num_processes < 1:
            raise ValueError("num_processes must be at least 1")
        self.num_processes = num_processes
        self._processor = processor
        self._lock = threading.Lock()
        self._executor: ProcessPoolExecutor | None = None

    def parse(self, body: bytes, conversation_field: str | None,
              model: type[BaseModel] | None = None, prepare: Prepare | None = None
              ) -> ParsedBody:
        """`body_limits.parse_validated(body, conversation_field, model)` in a child
        process; then, when the body validated as `model` and the parser has a processor,
        `prepare(processor, body)` there too."""
        executor = self._live_executor()
        try:
            return executor.submit(_parse_in_child, body, conversation_field, model,
                                   prepare).result()
        except BrokenProcessPool:
            self._replace(executor)
            return self._live_executor().submit(_parse_in_child, body, conversation_field,
                                                model, prepare).result()

    def shutdown(self) -> None:
        with self._lock:
            if self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)
                self._executor = None

    def _live_executor(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ProcessPoolExecutor(
                    self.num_processes, mp_context=multiprocessing.get_context("spawn"),
                    initializer=_start_child, initargs=(self._processor,))
            return self._executor

    def _replace(self, broken: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._executor is broken:
                broken.shutdown(wait=False, cancel_futures=True)
                self._executor = None


# The processor of a parsing child, set once by `_start_child` as the child starts (so that
# it is unpickled once per child, not once per body); None in every other process.
_child_processor: InputProcessor | None = None


def _start_child(processor: InputProcessor | None) -> None:
    global _child_processor
    _run_when_idle()
    _child_processor = processor


def _run_when_idle() -> None:
    """Puts this process in Linux's idle scheduling class: it runs on what CPU the others
    leave, and any other task that wakes up preempts it at once (at niceness 10 a waking
    task may wait for its slice: the victim's first-token p99 under the chats attack was
    1.7-1.8x its baseline, against 1.0-1.3x here). Niceness `BACKGROUND_NICENESS` where that
    class does not exist."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(BACKGROUND_NICENESS)


def _parse_in_child(body: bytes, conversation_field: str | None,
                    model: type[BaseModel] | None, prepare: Prepare | None) -> ParsedBody:
    value = parse_validated(body, conversation_field, model)
    if prepare is None or _child_processor is None or model is None \
            or not isinstance(value, model):
        return ParsedBody(value)
    return ParsedBody(value, prepare(_child_processor, value))


class PoolParsedRequest(Request):
    """A request whose `json()` parses a large body with the app's `state.body_parser`, on
    its `state.work_pool`, and returns it validated as `body_model` (the route's body model,
    if it has one) when it validates; a body over a count of `body_limits` is a 400 then."""

    def __init__(self, scope: Scope, receive: Receive,
                 body_model: type[BaseModel] | None = None) -> None:
        super().__init__(scope, receive)
        self.body_model = body_model

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            state = self.scope.setdefault("state", {})
            state[LARGE_BODY_STATE] = len(body) > INLINE_PARSE_BYTES
            if len(body) <= INLINE_PARSE_BYTES:
                self._json = json.loads(body)
            else:
                parsed = await self._parse_off_loop(body)
                self._json = parsed.value
                state[CHAT_PROMPT_STATE] = parsed.prepared
        return self._json

    async def _parse_off_loop(self, body: bytes) -> ParsedBody:
        pool: TenantWorkPool = self.app.state.work_pool
        parser: BodyParser = self.app.state.body_parser
        path = self.url.path
        prepare = prepared_chat_prompt if path in CHAT_PROMPT_PATHS else None
        try:
            return await pool.run(scope_tenant(self.scope), parser.parse, body,
                                  CONVERSATION_FIELDS.get(path), self.body_model, prepare,
                                  background=True)
        except BodyLimitError as error:
            raise APIError(400, error.message, param=error.param,
                           code="limit_exceeded") from error


class PoolParsedRoute(APIRoute):
    """A FastAPI route whose JSON body is parsed by `PoolParsedRequest` (and, when large,
    validated as the route's one pydantic body model)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        body_model = _pydantic_body_model(self)

        async def handle(request: Request) -> Response:
            return await handler(PoolParsedRequest(request.scope, request.receive, body_model))

        return handle


def _pydantic_body_model(route: APIRoute) -> type[BaseModel] | None:
    """The route's body model when its whole body is one pydantic model (FastAPI then
    validates the parsed JSON as that model); None when the body is embedded under names, or
    has parameters of its dependencies too (FastAPI's `body_field` is then a model it made)."""
    field = route.body_field
    params = route.dependant.body_params
    if field is None or len(params) != 1:
        return None
    model = field.field_info.annotation  # a model FastAPI made when the body is embedded
    if model is not params[0].field_info.annotation:
        return None
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None
