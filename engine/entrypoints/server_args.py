"""The flags of `continuum serve` (server, engine and replica flags) and the server settings
they give; shared by the single server (`engine.entrypoints.serve`) and the Ray Serve
replicas (`engine.replicas`)."""

from __future__ import annotations

import argparse
from typing import get_args

from engine.engine_args import EngineArgs
from engine.entrypoints.connections import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
)
from engine.entrypoints.openai.body_budget import DEFAULT_MAX_BODY_BYTES_IN_FLIGHT
from engine.entrypoints.openai.json_body import ChildCpuClass
from engine.entrypoints.openai.refusal_pacing import DEFAULT_MAX_PACED_REFUSALS_PER_TENANT
from engine.entrypoints.openai.serving import (
    DEFAULT_MAX_N,
    DEFAULT_MAX_PROMPTS,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    DEFAULT_MAX_STOP_STRINGS,
    DEFAULT_MAX_STOP_TOKEN_IDS,
    DEFAULT_MAX_STORED_RESPONSE_BYTES,
    DEFAULT_MAX_STORED_RESPONSES,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    ServerSettings,
)
from engine.entrypoints.openai.tenants import (
    DEFAULT_TENANT,
    Tenants,
    parse_tenant_flag,
    read_keys_file,
)
from engine.entrypoints.openai.work_pool import (
    DEFAULT_MAX_WAITING_PREPARATIONS,
    DEFAULT_PREPARATION_THREADS,
)
from engine.replicas.flags import add_replica_arguments
from engine.tool_calls import TOOL_PARSERS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds every flag of `continuum serve` to `parser`."""
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1",
                       help="address to bind (default: 127.0.0.1, this machine only)")
    group.add_argument("--port", type=int, default=8000,
                       help="port to bind; 0 picks a free one (default: 8000)")
    group.add_argument("--api-key", action="append", default=[], metavar="KEY",
                       help="require 'Authorization: Bearer KEY' on every endpoint but /health; "
                            "KEY names the tenant 'default' (repeatable)")
    group.add_argument("--tenant", action="append", default=[], metavar="NAME:KEY",
                       help="an API key naming tenant NAME (repeatable); tenants see only "
                            "their own jobs and, by default, their own cached prefixes")
    group.add_argument("--api-keys-file", default=None, metavar="PATH",
                       help="API keys and their tenants, a 'KEY TENANT' line each ('#' "
                            "comments allowed); keeps keys off the command line")
    group.add_argument("--share-prefix-cache", action="store_true",
                       help="let tenants hit each other's cached prefixes (default: each "
                            "tenant's prefix cache is its own)")
    group.add_argument("--served-model-name", default=None,
                       help="the model id clients use (default: the --model value)")
    group.add_argument("--tool-call-parser", default="auto", choices=sorted(TOOL_PARSERS),
                       help="how tool calls are found in output (default: auto = Hermes "
                            "<tool_call> tags, else Llama-3 JSON)")
    group.add_argument("--max-request-body-bytes", type=int,
                       default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                       help="larger request bodies get 413 (default: %(default)s)")
    group.add_argument("--max-body-bytes-in-flight", type=int,
                       default=DEFAULT_MAX_BODY_BYTES_IN_FLIGHT,
                       help="most bytes of request bodies held by the requests in progress; "
                            "with several tenants one tenant holds at most half (past that a "
                            "request gets 429); past the total 503 (default: %(default)s)")
    group.add_argument("--max-paced-refusals-per-tenant", type=int,
                       default=DEFAULT_MAX_PACED_REFUSALS_PER_TENANT,
                       help="a tenant refused for its body before any of it is read, less "
                            "than --retry-after-s after its previous such refusal was "
                            "answered, gets the answer that much later, its body unread "
                            "meanwhile, for at most this many of its requests at once; 0: "
                            "every refusal at once (default: %(default)s)")
    group.add_argument("--max-prompt-tokens", type=int, default=None,
                       help="longer prompts get 400 (default: up to --max-model-len)")
    group.add_argument("--max-output-tokens", type=int, default=None,
                       help="most tokens one completion may generate; a larger max_tokens gets "
                            "400 (default: up to --max-model-len)")
    group.add_argument("--max-n", type=int, default=DEFAULT_MAX_N,
                       help="most completions per request (n); more get 400 "
                            "(default: %(default)s)")
    group.add_argument("--max-prompts", type=int, default=DEFAULT_MAX_PROMPTS,
                       help="most prompts per completion request; more get 400 "
                            "(default: %(default)s)")
    group.add_argument("--max-stored-responses", type=int, default=DEFAULT_MAX_STORED_RESPONSES,
                       help="most responses the Responses API keeps for previous_response_id, "
                            "shared equally among the tenants (default: %(default)s)")
    group.add_argument("--max-stored-response-bytes", type=int,
                       default=DEFAULT_MAX_STORED_RESPONSE_BYTES,
                       help="most bytes of stored responses (their JSON) in all, shared "
                            "equally among the tenants (default: %(default)s)")
    group.add_argument("--preparation-threads", type=int, default=DEFAULT_PREPARATION_THREADS,
                       help="threads that parse large bodies, check grammars, render chats and "
                            "tokenize; with several tenants one tenant uses at most half of "
                            "them (default: %(default)s)")
    group.add_argument("--large-body-cpu", choices=get_args(ChildCpuClass), default="idle",
                       help="how the processes that parse bodies over 64 KiB, and render and "
                            "tokenize chats among them, share the CPU: idle (Linux's idle "
                            "scheduling class: only CPU nothing else wants; a large body may "
                            "wait long on a machine whose cores all stay busy) or niceness "
                            "(niceness 10: a tenth of a contended core) (default: %(default)s)")
    group.add_argument("--max-waiting-preparations", type=int,
                       default=DEFAULT_MAX_WAITING_PREPARATIONS,
                       help="a tenant with this many requests waiting for those threads gets "
                            "429 for the next (default: %(default)s)")
    group.add_argument("--max-stop-strings", type=int, default=DEFAULT_MAX_STOP_STRINGS,
                       help="most stop strings per request; more get 400 (default: %(default)s)")
    group.add_argument("--max-stop-token-ids", type=int, default=DEFAULT_MAX_STOP_TOKEN_IDS,
                       help="most stop_token_ids per request; more get 400 "
                            "(default: %(default)s)")
    group.add_argument("--max-waiting-requests", type=int, default=None,
                       help="a request whose completions (prompts x n) would take the engine "
                            "requests waiting past this gets 429 with Retry-After, and nothing "
                            "of it is queued (default: no limit)")
    group.add_argument("--retry-after-s", type=int, default=1,
                       help="the Retry-After of a 429, seconds (default: %(default)s)")
    group.add_argument("--shutdown-timeout-s", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                       help="on SIGTERM, requests in flight get this long to finish before "
                            "their streams end with an error event (default: %(default)s)")
    group.add_argument("--header-timeout-s", type=float, default=DEFAULT_HEADER_TIMEOUT_S,
                       help="a connection that has not sent complete request headers this "
                            "long after it opened (or after the first byte of its next "
                            "request) gets 408 and is closed; seconds (default: %(default)s)")
    group.add_argument("--body-timeout-s", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                       help="a request whose whole body has not arrived this long after its "
                            "headers gets 408 and its connection is closed; seconds "
                            "(default: %(default)s)")
    group.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                       help="most client connections held open at once; one more gets 503 "
                            "and is closed at once; lowered to fit the open-file limit "
                            "(default: %(default)s connections)")
    group.add_argument("--log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug"])
    EngineArgs.add_cli_args(parser)
    add_replica_arguments(parser)


def tenants_from_args(args: argparse.Namespace) -> Tenants | None:
    """The tenants of `--api-key`, `--tenant` and `--api-keys-file`; None when none is
    given (no authentication); ValueError naming what is malformed."""
    pairs = [(key, DEFAULT_TENANT) for key in args.api_key]
    pairs += [parse_tenant_flag(value) for value in args.tenant]
    if args.api_keys_file is not None:
        pairs += read_keys_file(args.api_keys_file)
    if not pairs:
        if args.share_prefix_cache:
            raise ValueError("--share-prefix-cache needs API keys (there are no tenants)")
        return None
    return Tenants.from_pairs(pairs, share_prefix_cache=args.share_prefix_cache)


def server_settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """The server's settings from `continuum serve`'s flags; ValueError naming a bad one."""
    return ServerSettings(
        served_model_name=args.served_model_name or args.model,
        tenants=tenants_from_args(args), max_request_body_bytes=args.max_request_body_bytes,
        max_body_bytes_in_flight=args.max_body_bytes_in_flight,
        max_paced_refusals_per_tenant=args.max_paced_refusals_per_tenant,
        tool_call_parser=args.tool_call_parser, max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens, max_n=args.max_n,
        max_prompts=args.max_prompts, max_stop_strings=args.max_stop_strings,
        max_stop_token_ids=args.max_stop_token_ids,
        max_waiting_requests=args.max_waiting_requests, retry_after_s=args.retry_after_s,
        shutdown_timeout_s=args.shutdown_timeout_s,
        max_stored_responses=args.max_stored_responses,
        max_stored_response_bytes=args.max_stored_response_bytes,
        preparation_threads=args.preparation_threads,
        max_waiting_preparations=args.max_waiting_preparations,
        large_body_cpu=args.large_body_cpu,
    )
