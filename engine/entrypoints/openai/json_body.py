"""Request bodies parsed without holding the event loop.

CPython's JSON parser holds the GIL for the whole parse (0.2 s for 15 MB of small items), and
a parse in pure Python on a thread is worse: its threads take the GIL from the event loop
every few milliseconds, each time the loop wakes up (one victim's inter-token p99 went from
17 ms to 2.9 s). So a body over `INLINE_PARSE_BYTES`, one offering many tools
(`INLINE_PARSE_TOOLS`), or a `count_tokens` one, is parsed in a child process (`BodyParser`),
which also checks the counts of `body_limits`: a body over them never comes back into the
server's process. One within them is validated there as the route's body model and comes back
as the model's instance, which the route's validation then takes as it is: FastAPI's validation
holds the GIL in one piece on the event loop (an 8 MB chat of 2,000 messages: 20-36 ms; 10,000
Responses items: about 110 ms), while loading the instance's pickle runs on the parser's result
thread in Python that yields the GIL (5 ms; 10,000 items: about 90 ms, several times slower
than loading the parsed JSON). A body that does not validate comes back as its error, which the
route answers as its own validation would have, without validating it again on the event loop.
A chat request's conversation, and a `count_tokens` request's, is also rendered and tokenized
there (`CHILD_PROMPTS`), when the parser has the engine's input processor, for the same reason.
The child is asked from the server's `TenantWorkPool`, in the tenant's turn, and runs in
Linux's idle scheduling class (or at niceness 10: `ChildCpuClass`); the rest of such a
request's preparation runs at low CPU priority too (`ClientContext.large_body`). A body of a
mebibyte or more is joined from its chunks on the parser's thread (`BodyParser.join`), not on
the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import multiprocessing
import os
import pickle
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.types import Receive, Scope

from engine.entrypoints.openai.body_limits import BodyLimitError, parse_checked
from engine.entrypoints.openai.chat_prompt import ChatPrompt, chat_prompt_unless_refused
from engine.entrypoints.openai.errors import APIError, validation_message
from engine.entrypoints.openai.messages_prompt import count_prompt_unless_refused
from engine.entrypoints.openai.tenants import scope_tenant
from engine.entrypoints.openai.work_pool import BACKGROUND_NICENESS, TenantWorkPool
from engine.frontend.processor import InputProcessor

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

INLINE_PARSE_BYTES = 64 * 1024
# A body offering more tools than this (counted by their schemas' keys, `"parameters"` and
# `"input_schema"`, in one linear pass in C: about 10 us for 64 KiB) is parsed in the child
# whatever its size: rendering 1,024 tools holds the GIL for 40-70 ms, which on the server's
# threads delayed another tenant's first token 8-17x at 8 such requests at a time
# (`python -m lab bodies --attack tools`). So is every `count_tokens` body
# (`ALWAYS_OFF_LOOP_PATHS`): it renders a whole prompt and never waits for the engine, so
# nothing else paces a client that sends it in a loop.
INLINE_PARSE_TOOLS = 64
ALWAYS_OFF_LOOP_PATHS = frozenset({"/v1/messages/count_tokens"})
# The request scope's state key that says the body was parsed off the loop: the rest of
# its preparation runs in the work pool's background (`ClientContext.large_body`).
LARGE_BODY_STATE = "continuum_large_body"
# The scope's state key of a large body's `ChatPrompt`, made with the body in the child
# (`ClientContext.chat_prompt`), on the routes of `CHILD_PROMPTS`.
CHAT_PROMPT_STATE = "continuum_chat_prompt"
DEFAULT_PARSER_PROCESSES = 2
# Bodies of at least this many bytes in more than one chunk are joined on the parser's joining
# thread (`BodyParser.join`), not the event loop: CPython's `bytes.join` releases the GIL
# while it copies from 1 MiB up, and a smaller join takes tens of microseconds.
OFF_LOOP_JOIN_BYTES = 1 << 20
# How long a caller waits for a child's answer: far longer than any parse of a body the limits
# allow, so that only a lost answer (a future CPython leaves pending when its pool breaks
# while a body is submitted) ends in `ChildAnswerTimeout`, not a work-pool thread held forever.
CHILD_ANSWER_TIMEOUT_S = 120.0
# The body field that holds the conversation, by path (see `body_limits.check_counts`).
CONVERSATION_FIELDS = {"/v1/chat/completions": "messages", "/v1/responses": "input",
                       "/v1/messages": "messages", "/v1/messages/count_tokens": "messages"}


class ChildAnswerTimeout(TimeoutError):
    """A body-parsing child did not answer within its `BodyParser`'s `answer_timeout_s`."""


@dataclass(frozen=True)
class BodyRefusal:
    """The error a body that failed validation in the child gets, as the route's validation
    would have answered it (status, message, `param`, `code`)."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None


@dataclass(frozen=True)
class ParsedBody:
    """A body parsed in the child: `value`, the route's body model's instance when it
    validated as that model, or the parsed JSON when there is no model; `refusal`, instead,
    why it does not validate (so that the server's event loop does not validate it again: an
    8 MB chat takes 20-36 ms); `chat_prompt`, what the parse's `make_chat_prompt` made of a
    validated body (None when it did not run, or made nothing). When there is a
    `chat_prompt`, `value`'s conversation field is an empty list: the prompt stands for the
    conversation, which the route never reads then, and loading an 8 MB chat's 2,000
    messages back held the server's GIL for about 15 ms
    (`docs/decisions/0018-large-body-preparation.md`)."""

    value: Any
    chat_prompt: ChatPrompt | None = None
    refusal: BodyRefusal | None = None


# Makes a validated request's prompt with the child's input processor, or None to leave it to
# the route (see `chat_prompt.chat_prompt_unless_refused`).
MakeChatPrompt = Callable[[InputProcessor, Any], ChatPrompt | None]


@dataclass(frozen=True)
class ChildPrompt:
    """What the child makes of a route's validated body (`make`), and the body's fields the
    prompt stands for, with the empty values they take in the instance that comes back
    (`emptied`: the route never reads them then, and loading them back costs the server's
    GIL)."""

    make: MakeChatPrompt
    emptied: tuple[tuple[str, Any], ...]


# The routes whose large bodies' prompts are made in the child, by path.
CHILD_PROMPTS = {
    "/v1/chat/completions": ChildPrompt(chat_prompt_unless_refused, (("messages", []),)),
    "/v1/messages/count_tokens": ChildPrompt(
        count_prompt_unless_refused, (("messages", []), ("tools", None), ("system", None))),
}
# How the parse children share the CPU: Linux's idle scheduling class, or niceness 10.
ChildCpuClass = Literal["idle", "niceness"]


class BodyParser:
    """Parses large bodies in up to `num_processes` child processes (started as large bodies
    need them; a pool broken by a child's death is replaced at the next body). Each child
    holds a copy of `processor` (the engine's input processor, for a parse's
    `make_chat_prompt`; None: no prompt is made) and runs in `cpu_class`. Owned by the
    server (or the Ray ingress), which gives it as many processes as its work pool has
    background threads, so that no body waits here behind another tenant's: the pool's turns
    decide the order. Built on the event loop's thread; `parse` and `summary` are called
    from the work pool's threads, `join` and `joined` from the event loop, `shutdown` once
    at exit. A caller waits at most `answer_timeout_s` for a child's answer, per try (see
    `_in_child`); a child that hangs keeps its place in the pool.

    The pool's helper threads in the server's process (its manager, and its call queue's
    feeder, which pickles each body and writes it to a child 64 KiB at a time, taking the
    GIL for each write) run at the priority of the thread that built the parser: started
    from a background thread, they would run at its niceness 10, and one that the kernel
    preempts while it holds the GIL stalls the event loop until it runs again (the victim's
    first-token p99 under `python -m lab bodies --attack responses` was about 2 ms higher)."""

    def __init__(self, num_processes: int = DEFAULT_PARSER_PROCESSES,
                 processor: InputProcessor | None = None,
                 cpu_class: ChildCpuClass = "idle", *,
                 answer_timeout_s: float = CHILD_ANSWER_TIMEOUT_S) -> None:
        if num_processes < 1:
            raise ValueError("num_processes must be at least 1")
        if not answer_timeout_s > 0:
            raise ValueError("answer_timeout_s must be positive")
        self.num_processes = num_processes
        self.cpu_class = cpu_class
        self.answer_timeout_s = answer_timeout_s
        # Pickled once here, loaded by each child once it runs in its CPU class.
        self._processor_pickle = None if processor is None else _pickled(processor)
        self._lock = threading.Lock()
        self._executor: ProcessPoolExecutor | None = None
        # Starts each pool from a thread at this thread's priority (see above); its one
        # thread is started here, by a first call.
        self._launcher = ThreadPoolExecutor(1, thread_name_prefix="body-parser-launcher")
        self._launcher.submit(lambda: None).result()
        self._joiner = ThreadPoolExecutor(1, thread_name_prefix="body-joiner")

    def join(self, chunks: list[bytes]) -> Future[bytes]:
        """`b"".join(chunks)` on the parser's one joining thread, which the event loop's first
        call starts (so it runs at the loop's priority), for the loop to await
        (`PoolParsedRequest.body`): joining an 8 MB body's chunks on the loop held it about
        8 ms under `python -m lab bodies --attack chats` (2026-11-26). Not in the tenants' turns of
        the work pool, where it would wait behind another tenant's parse: each join takes
        milliseconds, and the body budget bounds the bytes waiting for one."""
        return self._joiner.submit(b"".join, chunks)

    async def joined(self, chunks: list[bytes]) -> bytes:
        """A body read in `chunks` (none empty), as one bytes object, for the event loop:
        the one chunk itself (never copied when it is bytes); joined on the loop below
        `OFF_LOOP_JOIN_BYTES`; else by `join`, off the loop. Used by `PoolParsedRequest.body`
        and the Ray ingress's body reader."""
        if len(chunks) == 1:
            return bytes(chunks[0])
        if sum(map(len, chunks)) < OFF_LOOP_JOIN_BYTES:
            return b"".join(chunks)
        return await asyncio.wrap_future(self.join(chunks))

    def parse(self, body: bytes, conversation_field: str | None,
              model: type[BaseModel] | None = None,
              prompt: ChildPrompt | None = None) -> ParsedBody:
        """`body` parsed as JSON and checked by `body_limits.parse_checked`, then validated
        as `model` (if given), in a child; when it validates and the parser has a processor,
        `prompt.make(processor, instance)` there too. JSONDecodeError or BodyLimitError for a
        body that does not parse or is over a limit."""
        return self._in_child(_parse_in_child, body, conversation_field, model, prompt)

    def summary(self, body: bytes, summarize: Callable[[bytes], _T]) -> _T:
        """`summarize(body)` in a child: only what it returns comes back into this process
        (it, and `summarize` itself, must pickle). Blocking, as `parse` is: called from the
        work pool's threads. For a caller that needs a little of a large body without
        parsing it in its own process: the Ray ingress reads a large body's route so
        (`ray_app.Ingress`)."""
        return self._in_child(summarize, body)

    def shutdown(self) -> None:
        with self._lock:
            if self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)
                self._executor = None
        self._launcher.shutdown(wait=False)
        self._joiner.shutdown(wait=False, cancel_futures=True)

    def _in_child(self, fn: Callable[..., _T], *args: Any) -> _T:
        """`fn(*args)` in a child, on a pool replaced and asked once more if a child's death
        broke it (before or while it ran `fn`); BrokenProcessPool if that one breaks too,
        ChildAnswerTimeout if a child does not answer in time."""
        executor = self._live_executor()
        try:
            return self._answer(executor.submit(fn, *args))
        except BrokenProcessPool:
            self._replace(executor)
            return self._answer(self._live_executor().submit(fn, *args))

    def _answer(self, future: Future[_T]) -> _T:
        try:
            return future.result(timeout=self.answer_timeout_s)
        except TimeoutError as error:
            if future.done():  # answered just now, or the child's own TimeoutError
                return future.result()
            future.cancel()
            raise ChildAnswerTimeout(f"no answer from a body-parsing process within "
                                     f"{self.answer_timeout_s:g} s") from error
        finally:
            # A child's error carries this frame in its traceback, and the future holds that
            # error: a cycle that only the cyclic collector would free, the refused body's
            # request with it (as `Future.result` itself avoids).
            del future

    def _live_executor(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = self._launcher.submit(self._started_executor).result()
            return self._executor

    def _started_executor(self) -> ProcessPoolExecutor:
        """A new pool whose manager thread, and through it its feeder thread, this thread
        starts. CPython's own step for that (which `submit` takes first) starts no child
        with the spawn context: each child is still spawned by the background thread whose
        body needs it, at its niceness, until `_start_child` sets its CPU class."""
        executor = ProcessPoolExecutor(
            self.num_processes, mp_context=multiprocessing.get_context("spawn"),
            initializer=_start_child, initargs=(self.cpu_class, self._processor_pickle))
        executor._start_executor_manager_thread()  # type: ignore[attr-defined]
        return executor

    def _replace(self, broken: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._executor is broken:
                broken.shutdown(wait=False, cancel_futures=True)
                self._executor = None


def _pickled(processor: InputProcessor) -> bytes | None:
    """`processor` pickled for the children; None (they make no prompts: the routes do) for
    one that cannot be, such as one whose tokenizer holds a lambda."""
    try:
        return pickle.dumps(processor)
    except Exception as error:  # pickling fails with many exception types
        logger.warning("the input processor cannot be copied into the body-parsing "
                       "processes (%s); large chats are rendered in the server's process", error)
        return None


# The input processor of a parsing child, loaded once by `_start_child` as the child starts
# (not once per body); None in every other process, and in a child given none.
_child_processor: InputProcessor | None = None


def _start_child(cpu_class: ChildCpuClass, processor_pickle: bytes | None) -> None:
    """Runs first in each parsing child: its CPU class, then (so that loading the tokenizer
    and any thread its libraries start already run in that class) its processor. A processor
    that does not load leaves the prompts to the routes."""
    global _child_processor
    _enter_cpu_class(cpu_class)
    if processor_pickle is None:
        return
    try:
        _child_processor = pickle.loads(processor_pickle)
    except Exception:  # unpickling fails with many exception types
        logger.exception("a body-parsing process cannot load the input processor; large "
                         "chats are rendered in the server's process")


def _enter_cpu_class(cpu_class: ChildCpuClass) -> None:
    """Puts every thread of this process in `cpu_class`: those started before this ran (by
    imports of the spawn's start-up, such as a BLAS pool's) and, through them, those started
    later. "idle": Linux's idle scheduling class, which runs on what CPU the others leave and
    which any other task that wakes up preempts at once (at niceness 10 a waking task may wait
    for its slice: the victim's first-token p99 under the chats attack was 1.7-1.8x its
    baseline, against 1.0-1.3x here); niceness `BACKGROUND_NICENESS` where that class does not
    exist. "niceness": that niceness, set rather than added (a child started from a
    background thread inherits its niceness 10)."""
    for thread_id in _thread_ids():
        if cpu_class == "idle" and _enter_idle_class(thread_id):
            continue
        with contextlib.suppress(OSError):  # a thread that ended; a niceness already higher
            os.setpriority(os.PRIO_PROCESS, thread_id, BACKGROUND_NICENESS)


def _thread_ids() -> list[int]:
    """This process's threads by their ids (Linux); elsewhere 0, the process."""
    try:
        return [int(name) for name in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def _enter_idle_class(thread_id: int) -> bool:
    """Whether the thread is now in the idle scheduling class (or has ended)."""
    try:
        os.sched_setscheduler(thread_id, os.SCHED_IDLE, os.sched_param(0))
    except ProcessLookupError:
        return True
    except (AttributeError, OSError):
        return False
    return True


def _parse_in_child(body: bytes, conversation_field: str | None,
                    model: type[BaseModel] | None,
                    prompt: ChildPrompt | None) -> ParsedBody:
    data = parse_checked(body, conversation_field)
    if model is None:
        return ParsedBody(data)
    try:
        instance = model.model_validate(data)
    except ValidationError as error:
        message, param = validation_message(RequestValidationError(error.errors()))
        return ParsedBody(None, refusal=BodyRefusal(400, message, param))
    except APIError as error:  # the model's own 400s
        return ParsedBody(None, refusal=BodyRefusal(error.status_code, error.message,
                                                    error.param, error.code))
    except Exception:
        # Anything else the route's own validation reports, in the route's error format.
        return ParsedBody(data)
    if prompt is None or _child_processor is None:
        return ParsedBody(instance)
    try:
        chat_prompt = prompt.make(_child_processor, instance)
    except Exception:
        # The route makes the prompt itself, and reports what fails as it does for any body.
        logger.exception("a body-parsing process could not make a request's prompt")
        return ParsedBody(instance)
    if chat_prompt is None:
        return ParsedBody(instance)
    return ParsedBody(instance.model_copy(update=dict(prompt.emptied)), chat_prompt)


def parsed_off_loop(path: str, body: bytes) -> bool:
    """Whether `body`, sent to `path`, is parsed (and its preparation run) off the event
    loop: one over `INLINE_PARSE_BYTES`, one offering more than `INLINE_PARSE_TOOLS` tools,
    and every one to `ALWAYS_OFF_LOOP_PATHS`."""
    return (len(body) > INLINE_PARSE_BYTES or path in ALWAYS_OFF_LOOP_PATHS
            or body.count(b'"parameters"') + body.count(b'"input_schema"') > INLINE_PARSE_TOOLS)


class PoolParsedRequest(Request):
    """A request whose `json()` parses a large body with the app's `state.body_parser`, on
    its `state.work_pool`, and returns it validated as `body_model` (the route's body model,
    if it has one); a body over a count of `body_limits`, or one that does not validate,
    raises its 400 there (the child's error: the route does not validate it again). Its
    `body()` joins a body of `OFF_LOOP_JOIN_BYTES` or more on the parser's thread."""

    def __init__(self, scope: Scope, receive: Receive,
                 body_model: type[BaseModel] | None = None) -> None:
        super().__init__(scope, receive)
        self.body_model = body_model

    async def body(self) -> bytes:
        """The body's bytes, as Starlette's `Request.body` reads them, but joined from its
        chunks by `BodyParser.join` when they are at least `OFF_LOOP_JOIN_BYTES` (a body
        that came in one chunk is that chunk, never copied)."""
        if not hasattr(self, "_body"):
            chunks: list[bytes] = []
            async with contextlib.aclosing(self.stream()) as stream:
                async for chunk in stream:
                    if chunk:
                        chunks.append(chunk)
            parser: BodyParser = self.app.state.body_parser
            self._body = await parser.joined(chunks)
        return self._body

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            state = self.scope.setdefault("state", {})
            state[LARGE_BODY_STATE] = parsed_off_loop(self.url.path, body)
            if not state[LARGE_BODY_STATE]:
                self._json = json.loads(body)
            else:
                parsed = await self._parse_off_loop(body)
                if parsed.refusal is not None:
                    refusal = parsed.refusal
                    raise APIError(refusal.status, refusal.message, param=refusal.param,
                                   code=refusal.code)
                self._json = parsed.value
                state[CHAT_PROMPT_STATE] = parsed.chat_prompt
        return self._json

    async def _parse_off_loop(self, body: bytes) -> ParsedBody:
        pool: TenantWorkPool = self.app.state.work_pool
        parser: BodyParser = self.app.state.body_parser
        path = self.url.path
        try:
            return await pool.run(scope_tenant(self.scope), parser.parse, body,
                                  CONVERSATION_FIELDS.get(path), self.body_model,
                                  CHILD_PROMPTS.get(path), background=True)
        except BodyLimitError as error:
            raise APIError(400, error.message, param=error.param,
                           code="limit_exceeded") from error
        except (BrokenProcessPool, ChildAnswerTimeout) as error:
            raise APIError(503, "the server's body-parsing processes failed; retry the "
                           "request", code="body_parser_failed") from error


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
