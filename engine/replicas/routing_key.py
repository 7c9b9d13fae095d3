"""The routing key of an HTTP request: what stands for its job when the ingress picks a replica.

The ingress cannot see the jobs that each replica's engine infers (job inference runs in the
engine core, on token ids), so it keys a request by what it can read from the JSON body and
headers, in this order:

1. an explicit job: `X-Job-Id`, the body's `job_id`, else its `prompt_cache_key` (the engine
   takes that as the job id too);
2. a Responses API follow-up: the key its `previous_response_id` was served under (the ingress
   remembers the keys of the responses it returned), since the conversation is stored on that
   replica;
3. a conversation's opening: the messages (or Responses input items) up to and including the
   first user message, with the system prompt or instructions; every later turn of an agent
   re-sends them unchanged, so its turns share the key that the engine's job inference joins
   into one job;
4. a completion's prompt opening: its first `PROMPT_PREFIX_CHARS` characters, or first
   `PROMPT_PREFIX_TOKENS` token ids.

Anything else (a batch of prompts, a malformed body, which the replica will refuse) has no key
and is load-balanced. Keys are strings; conversation keys are hashes, so no text is kept.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

PROMPT_PREFIX_CHARS = 2048
PROMPT_PREFIX_TOKENS = 512
JOB_ID_HEADER = "x-job-id"


def routing_key(path: str, body: Any, headers: Mapping[str, str],
                response_keys: Mapping[str, str]) -> str | None:
    """The key of a `POST` to `path` with the parsed JSON `body` and lower-cased `headers`;
    `response_keys` maps response ids to the keys they were served under. None: no key."""
    job_id = headers.get(JOB_ID_HEADER) or _text_field(body, "job_id")
    job_id = job_id or _text_field(body, "prompt_cache_key")
    if job_id:
        return job_key(job_id)
    if not isinstance(body, dict):
        return None
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        return _conversation_key(messages, None) if isinstance(messages, list) else None
    if path.endswith("/responses"):
        previous = _text_field(body, "previous_response_id")
        if previous:
            return response_keys.get(previous, f"response:{previous}")
        return _conversation_key(body.get("input"), body.get("instructions"))
    if path.endswith("/completions"):
        return _prompt_key(body.get("prompt"))
    return None


def job_key(job_id: str) -> str:
    """The key of an explicit job (what `GET /v1/jobs/{job_id}` routes by)."""
    return f"job:{job_id}"


def _text_field(body: Any, name: str) -> str | None:
    value = body.get(name) if isinstance(body, dict) else None
    return value if isinstance(value, str) else None


def _conversation_key(items: Any, instructions: Any) -> str | None:
    if isinstance(items, str):
        return _digest("conversation", [instructions, items])
    if not isinstance(items, list) or not items:
        return None
    opening: list[Any] = [instructions]
    for item in items:
        opening.append(item)
        if isinstance(item, dict) and item.get("role") == "user":
            break
    return _digest("conversation", opening)


def _prompt_key(prompt: Any) -> str | None:
    if isinstance(prompt, str):
        return _digest("prompt", prompt[:PROMPT_PREFIX_CHARS])
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return _digest("prompt", prompt[:PROMPT_PREFIX_TOKENS])
    if isinstance(prompt, list) and len(prompt) == 1:
        return _prompt_key(prompt[0])
    return None


def _digest(kind: str, value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return f"{kind}:{hashlib.blake2b(text.encode(), digest_size=12).hexdigest()}"
