"""What the completion and chat endpoints share: settings, request validation into engine
requests, usage, logprob token texts, SSE framing, stream merging and disconnect handling."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar, get_args

import msgspec
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response

from engine.config import setting
from engine.core.client import EngineDeadError
from engine.entrypoints.openai.body_budget import (
    DEFAULT_MAX_BODY_BYTES_IN_FLIGHT,
    BodyByteBudget,
)
from engine.entrypoints.openai.chat_prompt import ChatPrompt
from engine.entrypoints.openai.drain import ServerShuttingDownError
from engine.entrypoints.openai.errors import (
    APIError,
    engine_dead_error,
    error_body,
    shutting_down_error,
)
from engine.entrypoints.openai.generation import ChoiceOutput, GenerationPlan
from engine.entrypoints.openai.job_extension import job_info
from engine.entrypoints.openai.json_body import (
    CHAT_PROMPT_STATE,
    LARGE_BODY_STATE,
    ChildCpuClass,
)
from engine.entrypoints.openai.protocol import GenerationFields, Sampling
from engine.entrypoints.openai.refusal_pacing import (
    DEFAULT_MAX_PACED_REFUSALS_PER_TENANT,
    RefusalPacer,
)
from engine.entrypoints.openai.request_id import scope_request_id
from engine.entrypoints.openai.response_body import JSONPiecesResponse, json_pieces
from engine.entrypoints.openai.response_store import check_store_room
from engine.entrypoints.openai.structured_outputs import GrammarChecker, offer_structured_output
from engine.entrypoints.openai.tenant_requests import TenantEngineRequests
from engine.entrypoints.openai.tenants import (
    Tenants,
    engine_cache_salt,
    engine_job_id,
    scope_tenant,
)
from engine.entrypoints.openai.work_pool import (
    DEFAULT_MAX_WAITING_PREPARATIONS,
    DEFAULT_PREPARATION_THREADS,
    TenantWorkPool,
)
from engine.frontend.async_llm import AsyncLLM, QueueFullError
from engine.frontend.processor import ProcessedRequest, PromptTooLongError, token_count_text
from engine.frontend.request_outputs import CompletionOutput, RequestOutput, RequestRejected
from engine.frontend.token_bytes import TokenBytes
from engine.outputs import TokenLogprobs
from engine.request import JobInfo
from engine.sampling_params import MAX_INT32, RequestOutputKind, SamplingParams
from engine.structured_output.spec import StructuredOutputSpec
from engine.tool_calls import (
    TOOL_CALL_MARKERS,
    TOOL_PARSERS,
    ToolCallFormat,
    ToolParser,
    make_tool_parser,
)

DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_N = 16
DEFAULT_MAX_STOP_STRINGS = 16
DEFAULT_MAX_STOP_TOKEN_IDS = 256
DEFAULT_MAX_PROMPTS = 64
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
DEFAULT_MAX_STORED_RESPONSES = 10_000
DEFAULT_MAX_STORED_RESPONSE_BYTES = 256 * 1024 * 1024
# About 16 MB of JSON (docs/decisions/0029-response-weight-and-tenant-queue.md).
DEFAULT_MAX_RESPONSE_LOGPROBS = 1 << 20

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
BodyT = TypeVar("BodyT", bound=GenerationFields)
PreparedT = TypeVar("PreparedT", bound="Prepared")
_json = msgspec.json.Encoder()


class PacedRefusal(APIError):
    """A refusal that a client may repeat at a cost to the server, answered late to a tenant
    that repeats it (`OpenAIServing.refusals_paced`): a tenant over its cap of engine requests
    (429), and a response over `max_response_logprobs` once its prompts were tokenized
    (400)."""


@dataclass(frozen=True)
class ServerSettings:
    """How the HTTP layer behaves; the engine has its own config.

    `served_model_name` is the only model id requests may name; with `tenants`, one of their
    API keys is required as a bearer token on every endpoint but `/health`, and names the
    request's tenant. The limits answer 400 (413 for the body size, 429 for the queue) naming
    the limit:

    - `max_request_body_bytes`: the largest request body.
    - `max_body_bytes_in_flight`: the most bytes of request bodies that the requests in
      progress may hold in all; with several tenants, one tenant's at most half of it (but
      at least one largest body). Past a tenant's share a request gets 429, past the total
      503 (the only answer with one tenant), both with `Retry-After: retry_after_s`
      (`body_budget.BodyByteBudget`).
    - `max_paced_refusals_per_tenant`: a tenant refused for its body before any of it is
      read, less than `retry_after_s` after its previous such refusal was answered, gets the
      answer `retry_after_s` late, its body unread meanwhile, for at most this many of its
      requests at once; 0 answers every refusal at once (`refusal_pacing.RefusalPacer`).
    - `max_prompt_tokens`: the longest prompt (`None`: up to the model's context length).
    - `max_output_tokens`: the most tokens one completion may generate, asked for or by
      default (`None`: up to the context length).
    - `max_n`: the most completions one request may ask for.
    - `max_prompts`: the most prompts of one completion request.
    - `max_stop_strings`, `max_stop_token_ids`: the most `stop` strings and `stop_token_ids`
      of one request.
    - `max_waiting_requests`: a request whose completions (prompts x n) would take the number
      of engine requests waiting past this gets 429 with `Retry-After: retry_after_s`, and
      nothing of it is queued (`None`: no limit).
    - `max_waiting_requests_per_tenant`: the same for one tenant's engine requests in flight
      beyond its share of the batch (`max_num_seqs` / the tenants): its cap is that share
      plus this (`None`: `max_prompts` x `max_n`, so that any request fits when the tenant
      has none in flight; docs/decisions/0029-response-weight-and-tenant-queue.md); a request
      larger than the whole cap gets 400 (`tenant_requests.TenantEngineRequests`).
    - `max_response_logprobs`: the most logprob values (each token's and its alternatives')
      one response may carry, over all its choices and prompts, echoed prompts included,
      counted before any of it is computed from `max_tokens` (or the context left).
    - `max_stored_responses`, `max_stored_response_bytes`: the Responses API's store keeps at
      most this many responses, of at most this many bytes (their JSON) in all, shared equally
      among the tenants: each tenant's least recently used are evicted first, never another
      tenant's.

    `shutdown_timeout_s` is how long requests in flight may finish once the server is told to
    stop (SIGTERM); those still running then end with an error.

    `large_body_cpu`: how the child processes that parse bodies over 64 KiB or offering many
    tools (and render and tokenize chats among them) share the CPU. "idle": Linux's idle
    scheduling class, only CPU no other task wants, so that they never delay the engine's
    steps or other requests (a large body may then wait long on a machine whose every core
    stays busy); "niceness": niceness 10, a tenth of a contended core.
    """

    served_model_name: str = field(metadata=setting(
        "the model id requests name (default: --model)", group="model",
        metavar="NAME"))
    tenants: Tenants | None = None
    max_request_body_bytes: int = field(default=DEFAULT_MAX_REQUEST_BODY_BYTES, metadata=setting(
        "larger bodies get 413", group="server"))
    max_body_bytes_in_flight: int = field(
        default=DEFAULT_MAX_BODY_BYTES_IN_FLIGHT, metadata=setting(
            "body bytes held at once", group="server"))
    max_paced_refusals_per_tenant: int = field(
        default=DEFAULT_MAX_PACED_REFUSALS_PER_TENANT, metadata=setting(
            "most of a tenant's requests whose refusal for their body waits up to "
            "retry_after_s (0: every refusal at once)", group="server", flag=False))
    tool_call_parser: str = field(default="auto", metadata=setting(
        "auto: Hermes tags, else Llama-3 JSON",
        group="model", choices=TOOL_PARSERS))
    max_prompt_tokens: int | None = field(default=None, metadata=setting(
        "longer prompts get 400 (default: the context)", group="server"))
    max_output_tokens: int | None = field(default=None, metadata=setting(
        "largest max_tokens (default: the context)", group="server"))
    max_n: int = field(default=DEFAULT_MAX_N, metadata=setting(
        "most completions per request", group="server"))
    max_prompts: int = field(default=DEFAULT_MAX_PROMPTS, metadata=setting(
        "most prompts per request", group="server"))
    max_stop_strings: int = field(default=DEFAULT_MAX_STOP_STRINGS, metadata=setting(
        "most stop strings per request", group="server"))
    max_stop_token_ids: int = field(default=DEFAULT_MAX_STOP_TOKEN_IDS, metadata=setting(
        "most stop ids per request", group="server"))
    max_waiting_requests: int | None = field(default=None, metadata=setting(
        "queue limit, then 429 (default: no limit)", group="server"))
    max_waiting_requests_per_tenant: int | None = field(default=None, metadata=setting(
        "a tenant's queue past its share of max_num_seqs, then 429", group="server",
        default_text="max_prompts x max_n"))
    max_response_logprobs: int = field(default=DEFAULT_MAX_RESPONSE_LOGPROBS, metadata=setting(
        "logprob values per response", group="server"))
    retry_after_s: int = field(default=1, metadata=setting(
        "Retry-After of a 429 or 503", group="server", metavar="S"))
    shutdown_timeout_s: float = field(default=DEFAULT_SHUTDOWN_TIMEOUT_S, metadata=setting(
        "seconds to drain on SIGTERM", group="server", metavar="S"))
    max_stored_responses: int = field(default=DEFAULT_MAX_STORED_RESPONSES, metadata=setting(
        "most stored responses", group="server"))
    max_stored_response_bytes: int = field(
        default=DEFAULT_MAX_STORED_RESPONSE_BYTES, metadata=setting(
            "most stored bytes", group="server"))
    preparation_threads: int = field(default=DEFAULT_PREPARATION_THREADS, metadata=setting(
        "threads that prepare requests", group="server",
        default_text="the CPUs + 4, at most 32"))
    max_waiting_preparations: int = field(
        default=DEFAULT_MAX_WAITING_PREPARATIONS, metadata=setting(
            "429 for a tenant with this many waiting for them", group="server"))
    large_body_cpu: ChildCpuClass = field(default="idle", metadata=setting(
        "the CPU class of the processes parsing large bodies: idle (Linux's idle "
        "class) or niceness (niceness 10)", group="server", flag=False))

    def __post_init__(self) -> None:
        if not self.served_model_name:
            raise ValueError("served_model_name must not be empty")
        if self.max_request_body_bytes < 1024:
            raise ValueError("max_request_body_bytes must be at least 1024")
        if self.large_body_cpu not in get_args(ChildCpuClass):
            raise ValueError(f"large_body_cpu must be one of {get_args(ChildCpuClass)}, got "
                             f"{self.large_body_cpu!r}")
        if not 0 <= self.shutdown_timeout_s < float("inf"):
            raise ValueError(f"shutdown_timeout_s must be finite and at least 0, got "
                             f"{self.shutdown_timeout_s!r}")
        for name in ("max_prompt_tokens", "max_output_tokens", "max_n", "max_prompts",
                     "max_stop_strings", "max_stop_token_ids", "max_waiting_requests",
                     "max_waiting_requests_per_tenant", "max_response_logprobs",
                     "retry_after_s", "max_stored_responses", "max_stored_response_bytes",
                     "preparation_threads", "max_waiting_preparations",
                     "max_body_bytes_in_flight"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if (isinstance(self.max_paced_refusals_per_tenant, bool)
                or not isinstance(self.max_paced_refusals_per_tenant, int)
                or self.max_paced_refusals_per_tenant < 0):
            raise ValueError(f"max_paced_refusals_per_tenant must be an integer at least 0, "
                             f"got {self.max_paced_refusals_per_tenant!r}")
        if self.max_body_bytes_in_flight < self.max_request_body_bytes:
            raise ValueError(f"max_body_bytes_in_flight ({self.max_body_bytes_in_flight}) must "
                             f"be at least max_request_body_bytes "
                             f"({self.max_request_body_bytes})")
        check_store_room(self.max_stored_responses, self.max_stored_response_bytes,
                         self.num_tenants)

    @property
    def num_tenants(self) -> int:
        """How many tenants share the server (1 without API keys)."""
        return 1 if self.tenants is None else len(self.tenants.names)

    def tenant_request_cap(self, max_num_seqs: int) -> tuple[int, int]:
        """What one tenant may have in flight on an engine running at most `max_num_seqs`
        requests at once, in engine requests: its share of those (rounded up), and
        `max_waiting_requests_per_tenant` more."""
        waiting = self.max_waiting_requests_per_tenant
        if waiting is None:
            waiting = self.max_prompts * self.max_n
        return -(-max_num_seqs // self.num_tenants), waiting

    def work_pool(self) -> TenantWorkPool:
        """A new pool for the server's blocking work, as these settings size it."""
        return TenantWorkPool.for_tenants(
            self.num_tenants, self.preparation_threads,
            max_waiting_per_tenant=self.max_waiting_preparations,
            retry_after_s=self.retry_after_s)

    def body_budget(self) -> BodyByteBudget:
        """A new budget for the body bytes of the server's requests in progress (made once,
        by `build_app`, for the app's `BodyLimitsMiddleware`)."""
        return BodyByteBudget.for_tenants(
            self.num_tenants, self.max_body_bytes_in_flight, self.max_request_body_bytes,
            retry_after_s=self.retry_after_s)

    def refusal_pacer(self) -> RefusalPacer:
        """A new pacer for the refusals of the server's body budget (made once, by
        `build_app`, for the app's `BodyLimitsMiddleware`)."""
        return RefusalPacer(self.retry_after_s, self.max_paced_refusals_per_tenant)


@dataclass(frozen=True)
class ClientContext:
    """Who sent a request: its headers (which may carry the job extension), its tenant (None
    on a server without API keys), and its `X-Request-Id` (the client's or a generated one;
    None outside `RequestIdMiddleware`), which log lines about the request name;
    `large_body`: its body was too large to parse inline, so its preparation runs in the work
    pool's background (lower CPU priority); `chat_prompt`: a large chat body's conversation,
    made into its prompt in the child that parsed the body (None: made by the handler). When
    it is set, the body's messages are an empty list: the prompt stands for them."""

    headers: Mapping[str, str]
    tenant: str | None
    request_id: str | None = None
    large_body: bool = False
    chat_prompt: ChatPrompt | None = None

    @classmethod
    def of(cls, request: HTTPRequest) -> ClientContext:
        """The client of a request whose body was read (`PoolParsedRequest.json`)."""
        state = request.scope.get("state", {})
        return cls(headers=request.headers, tenant=scope_tenant(request.scope),
                   request_id=scope_request_id(request.scope),
                   large_body=bool(state.get(LARGE_BODY_STATE)),
                   chat_prompt=state.get(CHAT_PROMPT_STATE))


@dataclass(frozen=True, kw_only=True)
class Prepared:
    """A generation queued with the engine: its engine requests (one per prompt), their
    output streams, its client's tenant and `X-Request-Id` (for log lines), and how its
    output is read for tool calls (`parser`, None without tools). Each API's handler adds
    what its rendering needs."""

    requests: list[ProcessedRequest]
    streams: list[AsyncIterator[RequestOutput]]
    tenant: str | None
    client_request_id: str | None
    parser: ToolParser | None = None

    @property
    def request(self) -> ProcessedRequest:
        """The engine request of a one-prompt generation."""
        return self.requests[0]


class OpenAIServing(Generic[BodyT, PreparedT]):
    """Base of the generation handlers, one per API: validates a body of type `BodyT` into
    engine requests and queues them (`prepare`, which each API's `_prepare` fills in), then
    renders their outputs whole (`create`) or as a stream (`stream`).

    `prompt_param` names the body field that holds the prompt, and `max_tokens_param` the one
    that bounds the output, as the API's errors name them; with `clamps_max_tokens`, a
    `max_tokens` beyond the room the prompt leaves is cut to that room instead of refused
    (docs/decisions/0032-max-tokens-beyond-the-context.md). Blocking work runs on `pool`,
    which the server owns and shares among the handlers, and so are `grammar_checker` and
    `refusal_pacer`."""

    prompt_param: ClassVar[str] = "prompt"
    max_tokens_param: ClassVar[str] = "max_tokens"
    clamps_max_tokens: ClassVar[bool] = False

    def __init__(self, engine: AsyncLLM, settings: ServerSettings, pool: TenantWorkPool,
                 grammar_checker: GrammarChecker, refusal_pacer: RefusalPacer) -> None:
        make_tool_parser(settings.tool_call_parser)  # fail at start-up on an unknown name
        self.engine = engine
        self.settings = settings
        self.pool = pool
        self._token_texts: dict[int, str] = {}
        self._token_bytes = TokenBytes(engine.tokenizer)
        self.grammar_checker = grammar_checker
        self._in_flight = TenantEngineRequests.of(engine)
        self._refusal_pacer = refusal_pacer
        self._tool_call_marker_ids = engine.processor.special_token_ids(TOOL_CALL_MARKERS)

    async def prepare(self, body: BodyT, client: ClientContext) -> PreparedT:
        """Validates the request and queues it (all its engine requests or none); APIError on
        bad input, or 429 if the waiting queue or the tenant's cap has no room for its
        completions, a refusal for a limit paced (`refusals_paced`). Rendering, tokenizing
        and grammar checks run off the event loop."""
        async with self.refusals_paced(client.tenant):
            self.check_request(body)
            return await self._prepare(body, client)

    async def _prepare(self, body: BodyT, client: ClientContext) -> PreparedT:
        """The API's own validation and rendering of a body `check_request` passed, around
        `params_for`, up to `submit`."""
        raise NotImplementedError

    async def params_for(self, body: BodyT, plan: GenerationPlan, client: ClientContext
                         ) -> SamplingParams:
        """The engine's parameters for a generation its adapter planned: its constraint (the
        grammar built and checked off the event loop), then the sampling parameters; then a
        429 if its completions would find no room in the queue or the tenant's cap."""
        structured_output = None
        if plan.may_constrain:
            structured_output = await self.run_for(client, self._structured_output, plan)
        params = self.sampling_params(
            body, max_tokens=plan.max_tokens, logprobs=plan.logprobs,
            prompt_logprobs=plan.prompt_logprobs, stream=body.stream,
            structured_output=structured_output)
        self.check_queue_room(plan.num_completions, client.tenant)
        return params

    def _structured_output(self, plan: GenerationPlan) -> StructuredOutputSpec | None:
        constraint = None if plan.constraint is None else plan.constraint()
        return offer_structured_output(plan.offer, constraint, self.grammar_checker,
                                       self.settings.tool_call_parser)

    async def create(self, body: BodyT, prepared: PreparedT) -> dict[str, Any] | Response:
        """The whole (non-streaming) response, from the engine's final outputs."""
        raise NotImplementedError

    def stream(self, body: BodyT, prepared: PreparedT) -> AsyncIterator[bytes]:
        """The response as SSE events, as the engine's outputs arrive; a failure after the
        stream started is its last event (`stream_failure`)."""
        raise NotImplementedError

    def prompt_token_ids(self, params: SamplingParams, tokenize: Callable[..., list[int]],
                         *args: Any) -> list[int]:
        """`tokenize(*args)`, the prompt's token ids; a prompt too long for this server or
        the model, or one the processor refuses, as APIError(400) naming `prompt_param`."""
        try:
            return tokenize(*args)
        except PromptTooLongError as error:
            raise self.prompt_too_long(error, params) from error
        except ValueError as error:
            raise APIError(400, str(error), param=self.prompt_param) from error

    @contextlib.asynccontextmanager
    async def refusals_paced(self, tenant: str | None) -> AsyncIterator[None]:
        """Answers a `PacedRefusal` raised inside when the handlers' `RefusalPacer` says:
        late to a tenant refused again within `retry_after_s` (docs/decisions/0029-response-
        weight-and-tenant-queue.md), so that a client repeating it at once sends about one a
        second instead of hundreds, each costing the server its parse and tokenizing."""
        try:
            yield
        except PacedRefusal:
            await self._refusal_pacer.pace(tenant)
            raise

    async def run_for(self, client: ClientContext, fn: Callable[..., _T], *args: Any) -> _T:
        """`fn(*args)` on the work pool in `client`'s tenant's turn, in the background for a
        large body (`TenantWorkPool.run`)."""
        return await self.pool.run(client.tenant, fn, *args, background=client.large_body)

    def large_body_response(self, tenant: str | None,
                            pieces: Sequence[bytes | memoryview]) -> JSONPiecesResponse:
        """A large JSON body's response, sent at `tenant`'s pace
        (`TenantWorkPool.pace_large_body`)."""
        return JSONPiecesResponse(pieces, pace=functools.partial(self.pool.pace_large_body,
                                                                 tenant))

    @property
    def max_model_len(self) -> int:
        return self.engine.config.scheduler.max_model_len

    def check_request(self, body: GenerationFields) -> None:
        """Errors common to every generation request: unknown model, unsupported fields,
        a dead engine."""
        if body.model is not None and body.model != self.settings.served_model_name:
            raise APIError(404, f"the model {body.model!r} does not exist", param="model",
                           code="model_not_found")
        if self.engine.is_dead:
            raise engine_dead_error()

    def sampling_params(
        self, body: GenerationFields, *, max_tokens: int | None, logprobs: int | None,
        stream: bool,
        structured_output: StructuredOutputSpec | None = None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """The engine's parameters for the body; APIError(400) naming what is wrong."""
        sampling = body.sampling()
        self._check_limits(body, sampling, max_tokens=max_tokens)
        fields: dict[str, Any] = {
            "n": sampling.n, "temperature": sampling.temperature, "top_p": sampling.top_p,
            "top_k": body.top_k, "min_p": body.min_p,
            "presence_penalty": body.presence_penalty,
            "frequency_penalty": body.frequency_penalty,
            "repetition_penalty": body.repetition_penalty,
        }
        fields = {name: value for name, value in fields.items() if value is not None}
        try:
            return SamplingParams(
                **fields, seed=body.seed, max_tokens=max_tokens, min_tokens=body.min_tokens,
                stop=sampling.stop, stop_token_ids=tuple(body.stop_token_ids or ()),
                ignore_eos=body.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                logit_bias=self._logit_bias(body),
                include_stop_str_in_output=body.include_stop_str_in_output,
                skip_special_tokens=body.skip_special_tokens,
                output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
                structured_output=structured_output,
            )
        except ValueError as error:
            raise APIError(400, str(error)) from error

    def _logit_bias(self, body: GenerationFields) -> tuple[tuple[int, float], ...]:
        """`logit_bias` as (token id, bias) pairs; 400 for a key that is not the decimal id of
        a token of the vocabulary (the request model checks the biases and their count)."""
        vocab_size = self.engine.processor.vocab_size
        biases: dict[int, float] = {}
        for key, bias in (body.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit()) or int(key) >= vocab_size:
                raise APIError(400, f"logit_bias keys must be token ids in [0, {vocab_size}) "
                                    f"written in decimal, got {key[:32]!r}", param="logit_bias")
            if int(key) in biases:
                raise APIError(400, f"logit_bias names token {int(key)} more than once",
                               param="logit_bias")
            biases[int(key)] = bias
        return tuple(biases.items())

    def _check_limits(self, body: GenerationFields, sampling: Sampling, *,
                      max_tokens: int | None) -> None:
        settings = self.settings
        num_stop_token_ids = len(body.stop_token_ids or ())
        if num_stop_token_ids > settings.max_stop_token_ids:
            raise APIError(400, f"{num_stop_token_ids} stop_token_ids given, over this server's "
                                f"limit of {settings.max_stop_token_ids}",
                           param="stop_token_ids", code="limit_exceeded")
        if sampling.n > settings.max_n:
            raise APIError(400, f"n is {sampling.n}, over this server's limit of "
                                f"{settings.max_n}", param="n", code="limit_exceeded")
        if max_tokens is not None and max_tokens > MAX_INT32:
            raise APIError(400, f"{self.max_tokens_param} must be at most {MAX_INT32}, got "
                                f"{max_tokens}", param=self.max_tokens_param)
        limit = settings.max_output_tokens
        if max_tokens is not None and limit is not None and max_tokens > limit:
            raise APIError(400, f"{self.max_tokens_param} is {max_tokens}, over this server's "
                                f"limit of {limit}", param=self.max_tokens_param,
                           code="limit_exceeded")
        if len(sampling.stop) > settings.max_stop_strings:
            raise APIError(400, f"{len(sampling.stop)} stop strings given, over this server's "
                                f"limit of {settings.max_stop_strings}", param="stop",
                           code="limit_exceeded")

    def check_queue_room(self, num_completions: int, tenant: str | None = None) -> None:
        """429 with Retry-After if `num_completions` more would take the waiting queue past
        `max_waiting_requests`, or `tenant`'s requests in flight past its cap (on a server with
        API keys, only when the tenant is given): a cheap early answer before a request is
        prepared; `submit` decides."""
        with self._refusals_as_api_errors():
            self.engine.check_queue_room(num_completions, self.settings.max_waiting_requests)
        if tenant is not None or self.settings.tenants is None:
            self._check_tenant_room(tenant, num_completions)

    def submit(self, requests: list[ProcessedRequest]) -> list[AsyncIterator[RequestOutput]]:
        """Queues the requests with the engine, all or none, and returns their output streams;
        429 with Retry-After if their completions would take the waiting queue past
        `max_waiting_requests` or their tenant's requests in flight past its cap (nothing is
        queued then). They count toward their tenant until `abort` or `abort_nowait`."""
        tenant = requests[0].core_requests[0].tenant if requests else None
        num_new = sum(len(processed.core_requests) for processed in requests)
        with self._refusals_as_api_errors():
            self.engine.check_queue_room(num_new, self.settings.max_waiting_requests)
        self._check_tenant_room(tenant, num_new)
        with self._refusals_as_api_errors():
            try:
                streams = self.engine.submit(
                    requests, max_waiting_requests=self.settings.max_waiting_requests)
            except EngineDeadError as error:
                raise engine_dead_error(error) from error
        self._in_flight.add(tenant, requests)
        return streams

    def _check_tenant_room(self, tenant: str | None, num_new: int) -> None:
        """429 with Retry-After if `num_new` more engine requests would take `tenant`'s in
        flight past its cap; 400 if they alone are over it (retrying could never succeed)."""
        share, waiting = self.settings.tenant_request_cap(
            self.engine.config.scheduler.max_num_seqs)
        limit = share + waiting
        num_in_flight = self._in_flight.count(tenant)
        if num_in_flight + num_new <= limit:
            return
        why = (f"this client's limit of {limit} engine requests in flight ({share}, its share "
               f"of max_num_seqs, and {waiting} waiting, max_waiting_requests_per_tenant)")
        if num_new > limit:
            raise APIError(400, f"this request needs {num_new} engine requests (prompts x n), "
                                f"over {why}", param="n", code="limit_exceeded")
        raise PacedRefusal(429, f"this client has {num_in_flight} engine requests in flight "
                                f"and this request adds {num_new} (prompts x n), over {why}; "
                                f"retry later", code="rate_limit_exceeded",
                           headers={"Retry-After": str(self.settings.retry_after_s)})

    def check_response_logprobs(self, num_values: int, counted: str, *,
                                paced: bool = True) -> None:
        """400 if a response would carry more than `max_response_logprobs` logprob values
        (a `PacedRefusal` unless not `paced`: one checked before any work); `counted` says how
        they were counted, for the message."""
        limit = self.settings.max_response_logprobs
        if num_values > limit:
            refusal = PacedRefusal if paced else APIError
            raise refusal(400, f"this response would carry {num_values} logprob values "
                                f"({counted}), over this server's limit of {limit} "
                                f"(max_response_logprobs); ask for fewer tokens, choices or "
                                f"logprobs", param="logprobs", code="limit_exceeded")

    @contextlib.contextmanager
    def _refusals_as_api_errors(self) -> Iterator[None]:
        """QueueFullError as 429, or 400 for a request that alone needs more room than the
        queue has (retrying could never succeed); a drained server's refusal as 503."""
        try:
            yield
        except QueueFullError as error:
            if error.num_new > error.limit:
                raise APIError(400, f"this request needs {error.num_new} places in the waiting "
                                    f"queue (prompts x n), over this server's limit of "
                                    f"{error.limit}", param="n",
                               code="limit_exceeded") from error
            raise APIError(429, f"the server is busy: {error}; retry later", code="queue_full",
                           headers={"Retry-After": str(self.settings.retry_after_s)}) from error
        except ServerShuttingDownError as error:
            raise shutting_down_error(error) from error

    async def abort(self, requests: list[ProcessedRequest]) -> None:
        """Stops whichever of the requests still run (their response ended, or ended early);
        they no longer count toward their tenant."""
        self._in_flight.release(requests)
        for processed in requests:
            await self.engine.abort(processed.request_id)

    def abort_nowait(self, requests: list[ProcessedRequest]) -> None:
        """`abort` without awaiting, for a `finally` that may run in a cancelled task."""
        self._in_flight.release(requests)
        for processed in requests:
            self.engine.abort_nowait(processed.request_id)

    def process(
        self, request_id: str, token_ids: list[int], params: SamplingParams,
        body: GenerationFields, client: ClientContext,
        continues_request_id: str | None = None,
        tool_call_format: ToolCallFormat | None = None,
    ) -> ProcessedRequest:
        """The validated engine request; APIError(400) naming what is wrong (including a
        prompt plus `max_tokens`, or `min_tokens`, beyond the model's context). The request's
        job and cache salt are its tenant's. `continues_request_id`: the finished engine
        request whose turn this one continues, if known, and `tool_call_format`: how its
        output is read for tool calls, if it offers tools (see `engine.request.Request`);
        then the tool-call markers stay in the output text even where they are special
        tokens, for the parser to read."""
        kept = frozenset() if tool_call_format is None else self._tool_call_marker_ids
        logger.debug("request id %s: engine request %s", client.request_id, request_id)
        params = self._check_prompt_length(len(token_ids), params)
        self.check_response_logprobs(self.num_logprob_values(len(token_ids), params),
                                     "its tokens x choices x (1 + logprobs)")
        try:
            return self.engine.processor.process(
                request_id, token_ids, params, job=self._job(body, client),
                priority=body.priority, cache_salt=engine_cache_salt(
                    client.tenant, body.cache_salt, share_prefix_cache=self._shares_cache),
                tenant=client.tenant, kept_special_token_ids=kept,
                continues_request_id=continues_request_id, tool_call_format=tool_call_format,
            )
        except ValueError as error:
            raise APIError(400, str(error)) from error

    @property
    def _shares_cache(self) -> bool:
        return self.settings.tenants is not None and self.settings.tenants.share_prefix_cache

    @staticmethod
    def _job(body: GenerationFields, client: ClientContext) -> JobInfo | None:
        """The request's job, its id in its tenant's namespace. Tool names stay shared: the
        estimator learns a tool's durations from every tenant, and a warm start from a
        trace names tools without tenants."""
        job = job_info(body, client.headers)
        if job is None or client.tenant is None:
            return job
        return msgspec.structs.replace(job, job_id=engine_job_id(client.tenant, job.job_id))

    def num_logprob_values(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """The most logprob values an engine request of `params` with a prompt of
        `num_prompt_tokens` may return, in all its choices: each generated token's logprob
        and its alternatives (up to `max_tokens`, or the context left), and with prompt
        logprobs each prompt token's, in every choice (as `echo` shows them)."""
        num_values = 0
        if params.logprobs is not None:
            num_tokens = params.max_tokens
            if num_tokens is None:
                num_tokens = max(0, self.max_model_len - num_prompt_tokens)
            num_values += num_tokens * (1 + params.logprobs)
        if params.prompt_logprobs is not None:
            num_values += num_prompt_tokens * (1 + params.prompt_logprobs)
        return params.n * num_values

    def prompt_too_long(self, error: PromptTooLongError, params: SamplingParams) -> APIError:
        """The error `process` gives a prompt that the processor found too long before
        building its ids (see `engine.frontend.text_encoder`): this server's prompt limit or
        OpenAI's `context_length_exceeded`."""
        try:
            self._check_prompt_length(error.num_tokens, params, at_least=error.at_least)
        except APIError as api_error:
            return api_error
        return APIError(400, str(error), param=self.prompt_param)

    def _check_prompt_length(self, num_prompt_tokens: int, params: SamplingParams, *,
                             at_least: bool = False) -> SamplingParams:
        """`params` with the default `max_tokens` for a prompt of `num_prompt_tokens` (at
        least that many with `at_least`: a text too long by its length alone, not
        tokenized); APIError(400) if it is over this server's limit or leaves too little of
        the context."""
        max_prompt_tokens = self.settings.max_prompt_tokens
        count = token_count_text(num_prompt_tokens, at_least)
        if max_prompt_tokens is not None and num_prompt_tokens > max_prompt_tokens:
            raise APIError(400, f"the prompt has {count} tokens, over this "
                                f"server's limit of {max_prompt_tokens}", param="prompt",
                           code="limit_exceeded")
        params = self._default_max_tokens(params, num_prompt_tokens)
        return self._fit_context(num_prompt_tokens, params, count)

    def context_overflow(self, count: str) -> APIError:
        """The error for a prompt of `count` tokens that leaves no room for output: OpenAI's
        `context_length_exceeded`, naming the prompt's field as OpenAI does."""
        return APIError(
            400,
            f"this model's maximum context length is {self.max_model_len} tokens, but the "
            f"prompt has {count}, which leaves no room for output; "
            f"reduce the length of the {self.prompt_param}",
            param=self.prompt_param, code="context_length_exceeded",
        )

    def _fit_context(self, num_prompt_tokens: int, params: SamplingParams,
                     count: str) -> SamplingParams:
        """`params`, `max_tokens` cut to the room left with `clamps_max_tokens`; else
        OpenAI's `context_length_exceeded` for a prompt that leaves no room for output
        (`context_overflow`) or not `max_tokens` of it (naming `max_tokens`: the prompt
        fits, the completion asked for does not). `count` is the prompt's length as the
        client is told it ("at least N" for a lower bound)."""
        room = self.max_model_len - num_prompt_tokens
        if room <= 0:
            raise self.context_overflow(count)
        if (self.clamps_max_tokens and params.max_tokens is not None
                and params.max_tokens > room and not params.min_tokens > room):
            return msgspec.structs.replace(params, max_tokens=room)
        if params.max_tokens is not None and params.max_tokens > room:
            raise APIError(
                400,
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"{num_prompt_tokens + params.max_tokens} were requested ({num_prompt_tokens} "
                f"in the {self.prompt_param}, {params.max_tokens} for the completion); reduce "
                f"the length of the {self.prompt_param} or the completion",
                param=self.max_tokens_param, code="context_length_exceeded",
            )
        if params.min_tokens and params.min_tokens > room:
            raise APIError(
                400,
                f"min_tokens is {params.min_tokens}, but this model's maximum context length "
                f"of {self.max_model_len} tokens leaves room for {max(room, 0)} after the "
                f"{num_prompt_tokens}-token prompt",
                param="min_tokens", code="context_length_exceeded",
            )
        return params

    def _default_max_tokens(self, params: SamplingParams, num_prompt_tokens: int
                            ) -> SamplingParams:
        """Without `max_tokens`, a completion may fill the context, up to `max_output_tokens`."""
        limit = self.settings.max_output_tokens
        if params.max_tokens is not None or limit is None:
            return params
        room = max(1, self.max_model_len - num_prompt_tokens)
        try:
            return msgspec.structs.replace(params, max_tokens=min(limit, room))
        except ValueError as error:  # min_tokens above the default
            raise APIError(400, str(error), param="min_tokens") from error

    def token_logprobs(self, entries: list[TokenLogprobs]) -> list[dict[str, Any]]:
        """Chat's and the Responses API's logprob entries: each token with its text, logprob,
        bytes (its own, also where it holds part of a character: `TokenBytes`) and top
        alternatives."""
        return [{**self._token_logprob(entry.token_id, entry.logprob),
                 "top_logprobs": [self._token_logprob(token_id, logprob) for token_id, logprob
                                  in zip(entry.top_token_ids, entry.top_logprobs, strict=True)]}
                for entry in entries]

    def _token_logprob(self, token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": self.token_text(token_id), "logprob": logprob,
                "bytes": list(self._token_bytes(token_id))}

    def token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.engine.tokenizer.decode([token_id])
            self._token_texts[token_id] = text
        return text

    @staticmethod
    def usage(num_prompt_tokens: int, num_completion_tokens: int,
              num_cached_tokens: int) -> dict[str, Any]:
        return {
            "prompt_tokens": num_prompt_tokens,
            "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
        }


def new_id(prefix: str, separator: str = "-") -> str:
    """A new unique id: OpenAI's chat and completion ids (`chatcmpl-...`), or with "_" the
    Responses API's and Anthropic's (`resp_...`, `msg_...`, `fc_...`)."""
    return f"{prefix}{separator}{uuid.uuid4().hex}"


# Line separators that JSON allows raw in strings but line-splitting SSE clients (httpx's
# `iter_lines`, for one) break lines at: U+2028, U+2029 and U+0085, in UTF-8. Their byte
# sequences cannot occur inside another character's encoding.
_LINE_BREAKING = ((b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"),
                  (b"\xc2\x85", b"\\u0085"))


def sse(payload: Mapping[str, Any]) -> bytes:
    """One SSE event holding `payload` as JSON on a single line."""
    return b"data: " + _single_line(_json.encode(payload)) + b"\n\n"


def sse_pieces(payload: Mapping[str, Any]) -> list[bytes]:
    """`sse(payload)` in pieces (`response_body.json_pieces`), for a large payload on a
    worker thread."""
    pieces = [_single_line(piece) for piece in json_pieces(payload)]
    return [b"data: ", *pieces, b"\n\n"]


def _single_line(data: bytes) -> bytes:
    """JSON with the characters that break SSE lines escaped (JSON fragments too: a
    fragment boundary never splits a character)."""
    for raw, escaped in _LINE_BREAKING:
        data = data.replace(raw, escaped)
    return data


SSE_DONE = b"data: [DONE]\n\n"


def rejected_param(error: ValueError) -> str | None:
    """The request field a rejection by the engine names (None when it names none)."""
    return error.param if isinstance(error, RequestRejected) else None


def stream_failure(error: BaseException, client_request_id: str | None) -> APIError:
    """What ends a response whose stream started (its status sent), for each API to render
    as its last event: the engine gone, the server's drain, the core's rejection of the
    request (400), or an unexpected failure (500, logged with the request's
    `X-Request-Id`)."""
    if isinstance(error, EngineDeadError):
        return engine_dead_error(error)
    if isinstance(error, ServerShuttingDownError):
        return shutting_down_error(error)
    if isinstance(error, ValueError):  # the core rejected the request
        return APIError(400, str(error), param=rejected_param(error))
    logger.exception("a response stream failed (request id %s)", client_request_id)
    return APIError(500, f"internal server error: {type(error).__name__}")


def sse_error(error: BaseException, client_request_id: str | None) -> bytes:
    """OpenAI's SSE event for a failure after the stream started (`stream_failure`)."""
    failure = stream_failure(error, client_request_id)
    return sse(error_body(failure.status_code, failure.message, param=failure.param,
                          code=failure.code))


async def merge_streams(
    streams: list[AsyncIterator[RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, tagged with their stream's index. Closing
    the merged stream (or an error in one) stops every request still running."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:  # type: ignore[type-var]
            async for output in only:
                yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                queue.put_nowait((index, output))
            queue.put_nowait((index, None))
        except Exception as error:
            queue.put_nowait((index, error))

    tasks = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        num_open = len(tasks)
        while num_open:
            index, item = await queue.get()
            if item is None:
                num_open -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


@dataclass(frozen=True)
class OutputDelta:
    """One engine delta of one choice, as the pipeline hands it to an API's renderer: the
    choice's output so far (`ChoiceOutput`: its tool calls once it finished), the engine's
    delta, the text of it that can be sent now, and the prompt's tokens read from the cache."""

    choice: ChoiceOutput
    completion: CompletionOutput
    text: str
    num_cached_tokens: int


async def choice_deltas(streams: list[AsyncIterator[RequestOutput]],
                        choices: Sequence[ChoiceOutput]) -> AsyncIterator[OutputDelta]:
    """The engine's outputs of a one-prompt generation as they come, pushed to their choices
    (`choices[i]` takes choice `i`'s deltas; a whole output is one delta)."""
    async with contextlib.aclosing(merge_streams(streams)) as outputs:
        async for _, output in outputs:
            for completion in output.outputs:
                choice = choices[completion.index]
                yield OutputDelta(choice, completion, choice.push(completion),
                                  output.num_cached_tokens)


async def cancel_on_disconnect(request: HTTPRequest, work: Awaitable[_T]) -> _T:
    """Awaits `work`, cancelling it if the client disconnects first (for non-streaming
    responses; a cancelled generation aborts its engine request)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise APIError(499, "the client disconnected", code="client_closed_request")
    finally:
        watcher.cancel()
        task.cancel()
