import pytest

from engine.request import FinishReason, JobInfo, Request, RequestStatus
from engine.sampling_params import SamplingParams


def test_token_views_and_lifecycle() -> None:
    request = Request("r", [1, 2, 3], SamplingParams(), arrival_time_s=1.0,
                      job=JobInfo(job_id="j", tool_name="grep"))
    request.append_output_token_id(9)
    assert request.num_tokens == 4 and request.num_output_tokens == 1
    assert request.prompt_token_ids == [1, 2, 3] and request.output_token_ids == [9]
    assert request.job_id == "j" and request.finish_reason is None
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert request.is_finished and request.finish_reason is FinishReason.LENGTH
    assert str(FinishReason.STOP) == "stop" and all(FinishReason)


@pytest.mark.parametrize(
    ("args", "message"),
    [(("", [1]), "request_id"), (("r", []), "at least one token"), (("r", [1, -2]), "token ids")],
)
def test_bad_requests_are_rejected(args, message) -> None:
    with pytest.raises(ValueError, match=message):
        Request(*args, SamplingParams(), arrival_time_s=0.0)


def test_job_info_validation() -> None:
    with pytest.raises(ValueError, match="job_id"):
        JobInfo(job_id="")
    with pytest.raises(ValueError, match="tool_name"):
        JobInfo(job_id="j", tool_name="")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompt_token_ids": [2**64]}, "token ids"),
        ({"priority": None}, "priority"),
        ({"priority": 1.5}, "priority"),
        ({"arrival_time_s": float("nan")}, "arrival_time_s"),
    ],
)
def test_values_that_would_break_hashing_or_ordering_are_rejected(kwargs, message) -> None:
    args = {"prompt_token_ids": [1, 2], "arrival_time_s": 0.0, **kwargs}
    with pytest.raises(ValueError, match=message):
        Request("r", args.pop("prompt_token_ids"), SamplingParams(), **args)
