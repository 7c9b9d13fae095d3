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
    requests: Mapping[str, Request],
    max_model_len: int,
    now_s: float,
) -> tuple[list[EngineCoreOutput], list[Request]]:
    """Appends each scheduled request's sampled tokens up to its stop condition; returns the
    outputs to report and the requests that stopped (their status already finished). A
    request's first output token stamps its `first_token_at_s` with `now_s` (the step's end
    on the scheduler's clock).

    Requests no longer in `requests` (aborted since) are skipped, and so are those whose
    prefill is still partial unless the step computed prompt logprobs for them (their output
    then carries those and no tokens).
    """
    outputs: list[EngineCoreOutput] = []
    stopped: list[Request] = []
    index_of = runner_output.req_id_to_index()
    for req_id in scheduler_output.num_scheduled_tokens:
        request = requests.get(req_id)
        if request is None:
            continue  # aborted since
        index = index_of[req_id]
        prompt_logprobs = runner_output.prompt_logprobs and runner_output.prompt_logprobs[index]
        prefilled = request.num_computed_tokens >= request.num_tokens
        token_ids = runner_output.sampled_token_ids[index] if prefilled else []
        if not token_ids:
            if prompt_logprobs:
                outputs.append(EngineCoreOutput(
                    request_id=req_id, new_token_ids=[],
                    num_cached_tokens=request.num_cached_tokens or 0,
                    prompt_logprobs=prompt_logprobs,
                ))
            continue
        if request.first_token_at_s is None:
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
