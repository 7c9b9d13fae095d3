"""The routing key of an HTTP request: what stands for its job when the ingress picks a replica.

The ingress cannot see the jobs that each replica's engine infers (job inference runs in the
engine core, on token ids), so it keys a request by what it can read from the JSON body and
headers, in this order:

1. an explicit job: `X-Job-Id`, the body's `job_id`, else its `prompt_cache_key` (the engine
   takes that as the job id too);
2. a conversation's opening: the messages (of Chat Completions or Anthropic's Messages API,
   or Responses input items, a string input being one user message) up to and including the
   first user message, with the system prompt or instructions (the Messages API's `system`),
   each message's content reduced to its text; every later turn of an agent
   re-sends them, so its turns share the key that the engine's job inference joins into one
   job;
3. a completion's prompt opening: its first `PROMPT_PREFIX_CHARS` characters, or first
   `PROMPT_PREFIX_TOKENS` token ids (so the turns of a job that names none share a key once
   its prompt is that long).

Anything else (a batch of prompts, a malformed body, which the replica will refuse) has no key
and is load-balanced. (A Responses API follow-up is routed by the response it continues; the
ingress does that.) Every key is scoped by the request's API key (its `Authorization` header,
or, without one, its `x-api-key` header read as the same key sent as a bearer token), so that
one API key's requests never share, or reveal, another's routing; keys are hashes, so no
prompt text is kept.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

PROMPT_PREFIX_CHARS = 2048
PROMPT_PREFIX_TOKENS = 512
JOB_ID_HEADER = "x-job-id"


def routing_key(path: str, body: Any, headers: Mapping[str, str]) -> str | None:
    """The key of a `POST` to `path` with the parsed JSON `body` and lower-cased `headers`;
    None: no key."""
    job_id = headers.get(JOB_ID_HEADER) or _text_field(body, "job_id")
    job_id = job_id or _text_field(body, "prompt_cache_key")
    if job_id:
        return job_key(job_id, headers)
    if not isinstance(body, dict):
        return None
    scope = _scope(headers)
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        return _conversation_key(scope, messages, None) if isinstance(messages, list) else None
    if path.endswith("/messages"):
        messages = body.get("messages")
        system = _message_text({"content": body.get("system")})["content"]
        return _conversation_key(scope, messages, system) if isinstance(messages, list) else None
    if path.endswith("/responses"):
        items = body.get("input")
        if isinstance(items, str):
            items = [{"role": "user", "content": items}]
        return _conversation_key(scope, items, body.get("instructions"))
    if path.endswith("/completions"):
        return _prompt_key(scope, body.get("prompt"))
    return None


@dataclass(frozen=True, slots=True)
class BodyRoute:
    """What the ingress routes a generation request by, read from its JSON body: its routing
    key (`routing_key`), and the `previous_response_id` it continues (a Responses API
    follow-up); each None when the body has none."""

    key: str | None
    previous_response_id: str | None


def body_route(path: str, headers: Mapping[str, str], body: bytes) -> BodyRoute:
    """The `BodyRoute` of a generation `POST` to `path` with lower-cased `headers` and JSON
    `body` (its bytes: one that does not parse, or nests past the parser's depth, has
    neither). Runs in the ingress's process for a small body, in a parsing child for a large
    one (`ray_app.Ingress`)."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return BodyRoute(None, None)
    previous = value.get("previous_response_id") if isinstance(value, dict) else None
    try:
        key = routing_key(path, value, headers)
    except RecursionError:  # an opening nested almost as deep as the parser goes: no key
        key = None
    return BodyRoute(key, previous if isinstance(previous, str) else None)


def job_key(job_id: str, headers: Mapping[str, str]) -> str:
    """The key of explicit job `job_id` (what `GET /v1/jobs/{job_id}` routes by), for the API
    key in lower-cased `headers`."""
    return f"{_scope(headers)}job:{job_id}"


def _scope(headers: Mapping[str, str]) -> str:
    authorization = headers.get("authorization", "")
    if not authorization and (api_key := headers.get("x-api-key", "").strip()):
        authorization = f"Bearer {api_key}"
    return hashlib.blake2b(authorization.encode(), digest_size=6).hexdigest() + "/"


def _text_field(body: Any, name: str) -> str | None:
    value = body.get(name) if isinstance(body, dict) else None
    return value if isinstance(value, str) else None


def _conversation_key(scope: str, items: Any, instructions: Any) -> str | None:
    if not isinstance(items, list) or not items:
        return None
    opening: list[Any] = [instructions]
    for item in items:
        opening.append(_message_text(item))
        if isinstance(item, dict) and item.get("role") == "user":
            break
    return _digest(scope, "conversation", opening)


def _message_text(item: Any) -> Any:
    """A message as its role and the text of its content, however the content is given (a
    string, or text parts)."""
    if not isinstance(item, dict):
        return item
    content = item.get("content")
    if isinstance(content, list):
        content = "".join(part.get("text", "") for part in content
                          if isinstance(part, dict) and isinstance(part.get("text"), str))
    return {"role": item.get("role"), "content": content}


def _prompt_key(scope: str, prompt: Any) -> str | None:
    if isinstance(prompt, str):
        return _digest(scope, "prompt", prompt[:PROMPT_PREFIX_CHARS])
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return _digest(scope, "prompt", prompt[:PROMPT_PREFIX_TOKENS])
    if isinstance(prompt, list) and len(prompt) == 1:
        return _prompt_key(scope, prompt[0])
    return None


def _digest(scope: str, kind: str, value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    # JSON escapes may leave a lone surrogate in the text ("\ud800"), which UTF-8 refuses.
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=12)
    return f"{scope}{kind}:{digest.hexdigest()}"
