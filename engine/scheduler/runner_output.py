"""Applying the executor's `ModelRunnerOutput` to the requests of the step it ran.

Called by `Scheduler.update_from_output()` once per step, after the executor ran the step
that `Scheduler.schedule()` planned. It appends sampled tokens and sets finished statuses on
the requests; the scheduler then retires those that stopped.
"""

from __future__ import annotations

from collections.abc import Mapping

from engine.outputs import EngineCoreOutput, ModelRunnerOutput
from engine.request import Request
from engine.scheduler.output import SchedulerOutput
from engine.scheduler.stop import check_stop


def apply_runner_output(
    scheduler_output: SchedulerOutput,
    runner_output: ModelRunnerOutput,
    scheduled: Mapping[str, Request],
    requests: Mapping[str, Request],
    max_model_len: int,
    now_s: float,
) -> tuple[list[EngineCoreOutput], list[Request]]:
    """Appends each scheduled request's sampled tokens up to its stop condition; returns the
    outputs to report and the requests that stopped (their status already finished). A
    request's first output token stamps its `first_token_at_s` with `now_s` (the step's end
    on the scheduler's clock).

    `scheduled` maps the step's request ids to the requests it scheduled, `requests` the
    unfinished ones now: a request no longer among them (aborted, or finished by an earlier
    step while this one ran, or its id reused since) is skipped. The runner's tokens decide
    who sampled (a prefill still partial samples nothing); a step's tokens of a request fill
    one of its `num_output_placeholders`. A request with no token gets an output only for
    the prompt logprobs the step computed for it. A request preempted after this step was
    launched still receives its token (it is waiting then, and is recomputed with it).
    """
    outputs: list[EngineCoreOutput] = []
    stopped: list[Request] = []
    index_of = runner_output.req_id_to_index()
    for req_id in scheduler_output.num_scheduled_tokens:
        request = scheduled.get(req_id)
        if request is None or requests.get(req_id) is not request:
            continue
        index = index_of[req_id]
        prompt_logprobs = runner_output.prompt_logprobs and runner_output.prompt_logprobs[index]
        token_ids = runner_output.sampled_token_ids[index]
        if not token_ids:
            if prompt_logprobs:
                outputs.append(EngineCoreOutput(
                    request_id=req_id, new_token_ids=[],
                    num_cached_tokens=request.num_cached_tokens or 0,
                    prompt_logprobs=prompt_logprobs,
                ))
            continue
        if not request.num_output_placeholders:
            raise RuntimeError(f"the runner sampled for {request}, which this step did not "
                               "schedule to sample")
        request.num_output_placeholders -= 1
        first_token = request.first_token_at_s is None
        if first_token:
            request.first_token_at_s = now_s
        new_token_ids = _append_output(request, token_ids, max_model_len)
        if request.status.is_finished:
            stopped.append(request)
        logprobs = runner_output.logprobs and runner_output.logprobs[index]
        outputs.append(EngineCoreOutput(
            request_id=req_id,
            new_token_ids=new_token_ids,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            num_cached_tokens=request.num_cached_tokens or 0,
            logprobs=logprobs[: len(new_token_ids)] if logprobs else None,
            prompt_logprobs=prompt_logprobs or None,
            job_id=request.job_id if first_token else None,
        ))
    return outputs, stopped


def _append_output(request: Request, token_ids: list[int], max_model_len: int) -> list[int]:
    """Appends tokens up to the first that stops the request; returns those appended."""
    for count, token_id in enumerate(token_ids, start=1):
        request.append_output_token_id(token_id)
        status = check_stop(request, max_model_len)
        if status is not None:
            request.status = status
            return token_ids[:count]
    return token_ids
