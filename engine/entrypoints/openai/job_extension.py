"""The job extension of a request: from its JSON body (what the OpenAI SDK's `extra_body`
produces) and from headers (which routers can see without parsing bodies).

Body fields: `job_id`, `is_last_step`, `tool_name` (alias `this_func_call`). Headers:
`X-Job-Id`, `X-Job-Last-Step`, `X-Tool-Name`. A field given both ways must agree. OpenAI's
`prompt_cache_key` (a hint that requests share a prompt prefix) names the job when neither
`job_id` nor `X-Job-Id` does. Job ids starting with `INFERRED_JOB_ID_PREFIX` are the
engine's (inferred jobs) and refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from engine.entrypoints.openai.errors import APIError
from engine.entrypoints.openai.protocol import MAX_ID_CHARS, JobFields
from engine.request import INFERRED_JOB_ID_PREFIX, JobInfo, is_inferred_job_id

JOB_ID_HEADER = "x-job-id"
LAST_STEP_HEADER = "x-job-last-step"
TOOL_NAME_HEADER = "x-tool-name"

_T = TypeVar("_T")

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def job_info(body: JobFields, headers: Mapping[str, str]) -> JobInfo | None:
    """The request's `JobInfo`, or None when it names no job; APIError(400) if the fields are
    inconsistent (a last step or tool name without a job, or body and headers disagree) or
    the job id is reserved. Shared by every endpoint whose body has the `JobFields`."""
    job_id = _merge("job_id", body.job_id, _header_text(headers, JOB_ID_HEADER))
    job_param = "job_id"
    if job_id is None and body.prompt_cache_key is not None:
        job_id, job_param = body.prompt_cache_key, "prompt_cache_key"
    is_last_step = _merge("is_last_step", body.is_last_step, _header_bool(headers))
    tool_name = _merge("tool_name", body.tool_name, body.this_func_call, field="this_func_call")
    tool_name = _merge("tool_name", tool_name, _header_text(headers, TOOL_NAME_HEADER))
    if job_id is None:
        if is_last_step or tool_name is not None:
            raise APIError(400, "is_last_step and tool_name need a job_id", param="job_id")
        return None
    if is_inferred_job_id(job_id):
        raise APIError(400, f"{job_param} must not start with {INFERRED_JOB_ID_PREFIX!r}, "
                            "alone or after a '/' (reserved for the jobs the engine infers)",
                       param=job_param)
    return JobInfo(job_id=job_id, is_last_step=bool(is_last_step), tool_name=tool_name)


def _merge(
    name: str, first: _T | None, second: _T | None, *, field: str | None = None
) -> _T | None:
    if first is not None and second is not None and first != second:
        other = field or f"the {name} header"
        raise APIError(400, f"{name} ({first!r}) disagrees with {other} ({second!r})",
                       param=name)
    return first if first is not None else second


def _header_text(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    if value is None:
        return None
    value = value.strip()
    if not value or len(value) > MAX_ID_CHARS:
        raise APIError(400, f"header {name} must hold 1 to {MAX_ID_CHARS} characters",
                       param=name)
    return value


def _header_bool(headers: Mapping[str, str]) -> bool | None:
    value = headers.get(LAST_STEP_HEADER)
    if value is None:
        return None
    text = value.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise APIError(400, f"header {LAST_STEP_HEADER} must be true or false, got {value!r}",
                   param=LAST_STEP_HEADER)
