"""Job inference on text: rollouts of one prompt are told apart by the text their output
came back as, which survives byte-level outputs that were not UTF-8 and answers a client
rewrote; a tie between different outputs still starts a new job.

The token ids here are bytes (a byte-level vocabulary, as the tiny model's), decoded as
UTF-8 with U+FFFD for what is not.
"""

from __future__ import annotations

import pytest

from engine.request import JobInfo, Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler.job_inference import MAX_TURNS_PER_KEY, JobInference, normalized_text
from engine.scheduler.policy import PolicyEnvironment
from tests.engine.helpers import make_scheduler

BLOCK_SIZE = 4
EOS = 0  # the NUL byte ends an output
PROMPT = list(b"<user>Name a colour.</user><assistant>")
END = list(b"</assistant><user>Why?</user><assistant>")


def _decode(token_ids) -> str:
    return bytes(token_ids).decode("utf-8", errors="replace")


def _inference(decode=_decode) -> JobInference:
    return JobInference(BLOCK_SIZE, max_turns=64, max_age_s=60.0, decode=decode)


def _request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=64), arrival_time_s=0.0,
                   eos_token_id=EOS)


def _finished_turn(inference: JobInference, request_id: str, output: bytes) -> Request:
    """A first turn of `PROMPT` that answered `output`, filed as finished."""
    request = _request(request_id, PROMPT)
    request.job = inference.infer(request, 0.0).job
    for token in output:
        request.append_output_token_id(token)
    request.status = RequestStatus.FINISHED_STOPPED
    assert inference.turn_finished(request, 1.0) == []
    return request


def _continuation(request_id: str, answer_as_sent: str) -> Request:
    """The next turn as a client sends it: the answer's text encoded again after the prompt."""
    return _request(request_id, [*PROMPT, *answer_as_sent.encode(), *END])


# Outputs that are not valid UTF-8: each comes back with U+FFFD where its bytes were.
ROLLOUTS = {"red": b"\xffRed, like \xc3", "blue": b"\xfe\xfeBlue sky",
            "green": b"\xffGreen\xff", "grey": b"\x80Grey"}


@pytest.mark.parametrize("order", [["red", "blue", "green", "grey"],
                                   ["grey", "green", "blue", "red"]])
def test_outputs_that_were_not_utf8_still_continue_their_own_rollout(order) -> None:
    inference = _inference()
    firsts = {name: _finished_turn(inference, name, output) for name, output in ROLLOUTS.items()}
    for name in order:
        sent = _decode(ROLLOUTS[name])  # what the client received, and sends back
        inferred = inference.infer(_continuation(f"next-{name}", sent), 2.0)
        assert inferred.job == firsts[name].job
        assert inferred.continues_request_id == name


def test_token_ids_alone_cannot_tell_these_rollouts_apart() -> None:
    inference = _inference(decode=None)
    assert not inference.matches_text
    firsts = {name: _finished_turn(inference, name, output) for name, output in ROLLOUTS.items()}
    inferred = inference.infer(_continuation("next-red", _decode(ROLLOUTS["red"])), 2.0)
    assert inferred.continues_request_id is None
    assert inferred.job.job_id not in {first.job_id for first in firsts.values()}


def test_an_answer_the_client_rewrote_continues_its_rollout() -> None:
    inference = _inference()
    answers = {"a": b"Blue, for  the sea.", "b": b"Green, for the grass.",
               "c": b"Blue, for the sky."}
    firsts = {name: _finished_turn(inference, name, answer) for name, answer in answers.items()}
    rewritten = "Thought: I can answer now.\nAnswer:  Blue, for the\tsea."
    inferred = inference.infer(_continuation("next-a", rewritten), 2.0)
    assert inferred.job == firsts["a"].job


def test_rollouts_whose_text_came_out_alike_tie_and_the_first_filed_is_continued() -> None:
    # Both finished at 1 s (in one step): the first filed, whose client was answered first.
    inference = _inference()
    one, _ = [_finished_turn(inference, name, output)
              for name, output in (("one", b"\xffok"), ("two", b"\xfeok"))]
    inferred = inference.infer(_continuation("next", "\ufffdok"), 2.0)
    assert inferred.continues_request_id == "one" and inferred.job == one.job


def test_a_whole_output_wins_over_a_longer_one_it_begins() -> None:
    inference = _inference()
    short = _finished_turn(inference, "short", b"Red")
    _finished_turn(inference, "long", b"Red and blue")
    inferred = inference.infer(_continuation("next", "Red"), 2.0)
    assert inferred.job == short.job


def test_a_decoder_that_fails_leaves_the_match_to_token_ids() -> None:
    def broken(token_ids) -> str:
        raise ValueError("cannot decode")

    inference = _inference(decode=broken)
    first = _finished_turn(inference, "a", b"Red")
    _finished_turn(inference, "b", b"Blue")
    inferred = inference.infer(_continuation("next", "Red"), 2.0)
    assert inferred.job == first.job  # its tokens came back as they were


def test_special_tokens_the_client_never_saw_do_not_count() -> None:
    inference = _inference()
    outputs = {"a": b"</think>\xe2<|im_end|>", "b": b"<tool_call>Blue</tool_call>",
               "c": b"Green<|im_start|>grass"}
    firsts = {name: _finished_turn(inference, name, output) for name, output in outputs.items()}
    # What each client received: the special tokens' text left out, bytes joined.
    received = {"a": "\ufffd", "b": "Blue", "c": "Greengrass"}
    for name in ("a", "c", "b"):
        inferred = inference.infer(_continuation(f"next-{name}", received[name]), 2.0)
        assert inferred.job == firsts[name].job, name


def test_an_empty_answer_is_told_apart_from_answers_that_did_not_come_back() -> None:
    inference = _inference()
    empty = _finished_turn(inference, "empty", bytes([EOS]))  # the EOS alone
    _finished_turn(inference, "red", b"Red")
    _finished_turn(inference, "blue", b"Blue")
    inferred = inference.infer(_continuation("next", ""), 2.0)
    assert inferred.job == empty.job


def test_normalised_text() -> None:
    assert normalized_text("  a \t b\n\nc  ") == "a b c"
    assert normalized_text("e\u0301") == "\u00e9"
    assert normalized_text("x\ufffd\ufffd\ufffdy") == "x\ufffdy"
    assert normalized_text("<tool_call>a<|im_end|>b</think> 1 < 2") == "ab 1 < 2"


def test_the_scheduler_matches_turns_by_text_with_the_engines_decoder() -> None:
    scheduler = make_scheduler(environment=PolicyEnvironment(decode=_decode),
                               block_size=BLOCK_SIZE, max_model_len=256)
    inference = scheduler.job_inference
    assert inference is not None and inference.matches_text
    firsts = {name: _finished_turn(inference, name, output) for name, output in ROLLOUTS.items()}
    next_green = _continuation("next-green", _decode(ROLLOUTS["green"]))
    scheduler.add_request(next_green)
    assert next_green.job == JobInfo(job_id=firsts["green"].job_id, inferred=True)


def test_a_flood_of_one_prompt_keeps_at_most_a_bounded_number_of_its_turns() -> None:
    # 2,000 requests of one prompt: the table keeps the latest MAX_TURNS_PER_KEY under its
    # key (the older ones' jobs end), so that a lookup checks that many candidates at most.
    inference = JobInference(BLOCK_SIZE, max_turns=4_096, max_age_s=600.0, decode=_decode)
    ended: list[str] = []
    jobs = []
    for index in range(2_000):
        request = _request(f"flood-{index}", PROMPT)
        request.job = inference.infer(request, 0.0).job
        jobs.append(request.job.job_id)
        for token in b"ok":
            request.append_output_token_id(token)
        request.status = RequestStatus.FINISHED_STOPPED
        ended += inference.turn_finished(request, float(index))
    assert len(inference) == MAX_TURNS_PER_KEY
    assert ended == jobs[:-MAX_TURNS_PER_KEY]  # the oldest first
    # The flood's turns are alike: a continuation joins the latest of them.
    inferred = inference.infer(_continuation("next", "ok"), 2_000.0)
    assert inferred.job.job_id == jobs[-1]


def test_turns_under_one_request_id_are_bounded_too() -> None:
    inference = JobInference(BLOCK_SIZE, max_turns=4_096, max_age_s=600.0, decode=_decode)
    for index in range(100):
        request = _request("same-id", [*PROMPT, *str(index).encode()])
        request.job = inference.infer(request, 0.0).job
        request.status = RequestStatus.FINISHED_STOPPED
        inference.turn_finished(request, float(index))
    assert len(inference) == MAX_TURNS_PER_KEY
