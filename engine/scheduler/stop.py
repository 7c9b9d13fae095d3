"""Stop conditions checked after every appended output token."""

from __future__ import annotations

from engine.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> RequestStatus | None:
    """The finished status the request's latest token puts it in, or None to go on.

    EOS (unless `ignore_eos`) and stop token ids count only once `min_tokens` tokens were
    generated, but EOS ends a constrained output at once (its grammar allowed EOS only where
    it is complete); `max_tokens` and `max_model_len` always apply. A stop token wins over the
    length limit when both hold (finish reason "stop"), as in vLLM V1.
    """
    params = request.sampling_params
    num_output_tokens = request.num_output_tokens
    last_token_id = request.all_token_ids[-1]
    past_min_tokens = num_output_tokens >= params.min_tokens
    if last_token_id == request.eos_token_id and not params.ignore_eos and (
            past_min_tokens or params.structured_output is not None):
        return RequestStatus.FINISHED_STOPPED
    if past_min_tokens and last_token_id in params.stop_token_ids:
        request.stop_reason = last_token_id
        return RequestStatus.FINISHED_STOPPED
    if request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    if params.max_tokens is not None and num_output_tokens >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None
