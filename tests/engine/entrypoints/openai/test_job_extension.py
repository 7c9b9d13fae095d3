"""The job extension from bodies and headers."""

from __future__ import annotations

import pytest

from engine.entrypoints.openai.errors import APIError
from engine.entrypoints.openai.job_extension import job_info
from engine.entrypoints.openai.protocol import JobFields
from engine.request import JobInfo


@pytest.mark.parametrize(("body", "headers", "expected"), [
    ({}, {}, None),
    ({"job_id": "j"}, {}, JobInfo(job_id="j")),
    ({}, {"x-job-id": "j"}, JobInfo(job_id="j")),
    ({"job_id": "j", "is_last_step": True, "tool_name": "bash"}, {},
     JobInfo(job_id="j", is_last_step=True, tool_name="bash")),
    ({"job_id": "j", "this_func_call": "bash"}, {}, JobInfo(job_id="j", tool_name="bash")),
    ({}, {"x-job-id": "j", "x-job-last-step": "TRUE", "x-tool-name": "grep"},
     JobInfo(job_id="j", is_last_step=True, tool_name="grep")),
    ({"job_id": "j"}, {"x-job-id": "j", "x-job-last-step": "0"}, JobInfo(job_id="j")),
    ({"is_last_step": False}, {}, None),  # clients that always send the field
])
def test_job_info(body, headers, expected):
    assert job_info(JobFields(**body), headers) == expected


@pytest.mark.parametrize(("body", "headers", "message"), [
    ({"job_id": "a"}, {"x-job-id": "b"}, "disagrees"),
    ({"tool_name": "a", "this_func_call": "b", "job_id": "j"}, {}, "disagrees"),
    ({"is_last_step": True}, {}, "need a job_id"),
    ({}, {"x-tool-name": "bash"}, "need a job_id"),
    ({}, {"x-job-id": "j", "x-job-last-step": "soon"}, "true or false"),
    ({}, {"x-job-id": "   "}, "1 to 256"),
    ({}, {"x-job-id": "x" * 300}, "1 to 256"),
])
def test_bad_job_fields(body, headers, message):
    with pytest.raises(APIError, match=message) as raised:
        job_info(JobFields(**body), headers)
    assert raised.value.status_code == 400
