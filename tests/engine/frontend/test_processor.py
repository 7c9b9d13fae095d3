"""Input validation, tokenization and chat templates."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig, SchedulerConfig
from engine.frontend.processor import InputProcessor
from engine.request import JobInfo
from engine.sampling_params import SamplingParams

IM_END, END_OF_TEXT = 258, 256


@pytest.fixture
def processor(tokenizer) -> InputProcessor:
    return InputProcessor.for_config(EngineConfig(scheduler=SchedulerConfig(max_model_len=32)),
                                     tokenizer)


def test_text_prompts_are_tokenized_and_token_prompts_kept(processor) -> None:
    processed = processor.process("a", "hi 日", SamplingParams())
    assert processed.prompt == "hi 日"
    assert processed.prompt_token_ids == list("hi 日".encode())
    assert processor.process("b", [5, 6], SamplingParams()).prompt is None


def test_model_eos_ids_become_the_eos_and_extra_stop_ids(processor) -> None:
    core_request = processor.process("a", [1], SamplingParams()).core_requests[0]
    assert core_request.eos_token_id == IM_END
    assert core_request.sampling_params.stop_token_ids == (END_OF_TEXT,)
    ignoring = processor.process("b", [1], SamplingParams(ignore_eos=True)).core_requests[0]
    assert ignoring.sampling_params.stop_token_ids == ()


def test_the_completions_of_a_request_share_its_stop_lists(processor) -> None:
    """Stop lists are held once per request, not once per completion, and stop strings stay
    in the frontend (which matches them)."""
    params = SamplingParams(n=4, seed=7, stop=("x" * 1000,), stop_token_ids=(3, 4))
    processed = processor.process("a", [1], params)
    core_params = [core.sampling_params for core in processed.core_requests]
    assert all(p.stop_token_ids is core_params[0].stop_token_ids for p in core_params)
    assert core_params[0].stop_token_ids == (3, 4, END_OF_TEXT)
    assert all(p.stop == () and p.n == 1 for p in core_params)
    assert [p.seed for p in core_params] == [7, 8, 9, 10]
    assert processed.sampling_params.stop == ("x" * 1000,)


def test_job_info_and_priority_reach_every_core_request(processor) -> None:
    job = JobInfo(job_id="job-1", tool_name="bash")
    processed = processor.process("a", [1], SamplingParams(n=3), job=job, priority=2)
    assert [(c.job, c.priority) for c in processed.core_requests] == [(job, 2)] * 3


@pytest.mark.parametrize(("prompt", "message"), [
    ("", "must not be empty"),
    ([], "at least one token"),
    ([1, 272], r"in \[0, 272\)"),
    ([1, -1], r"in \[0, 272\)"),
    ([1, True], r"in \[0, 272\)"),
    ([1] * 32, "no room for output"),
    ({"text": "x"}, "string or a list"),
])
def test_bad_prompts_are_rejected(processor, prompt, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        processor.process("a", prompt, SamplingParams())


def test_bad_ids_and_params_are_rejected(processor) -> None:
    with pytest.raises(ValueError, match="request_id"):
        processor.process("", [1], SamplingParams())
    with pytest.raises(ValueError, match="stop_token_ids"):
        processor.process("a", [1], SamplingParams(stop_token_ids=(999,)))
    with pytest.raises(ValueError, match="SamplingParams"):
        processor.process("a", [1], {"temperature": 0})
    with pytest.raises(ValueError, match="JobInfo"):
        processor.process("a", [1], SamplingParams(), job={"job_id": "j"})
    with pytest.raises(ValueError, match="priority"):
        processor.process("a", [1], SamplingParams(), priority="high")


def test_chat_prompt_renders_the_template_with_tools(tokenizer) -> None:
    processor = InputProcessor.for_config(
        EngineConfig(scheduler=SchedulerConfig(max_model_len=1024)), tokenizer)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    messages = [{"role": "user", "content": "weather?"}]
    token_ids = processor.chat_prompt(messages, tools=tools)
    text = tokenizer.decode(token_ids)
    assert text.startswith("<|im_start|>system\n# Tools")
    assert '"name": "get_weather"' in text
    assert text.endswith("<|im_start|>user\nweather?<|im_end|>\n<|im_start|>assistant\n")


def test_a_chat_or_prompt_longer_than_the_model_is_rejected_with_its_length(processor) -> None:
    with pytest.raises(ValueError, match=r"the prompt has 32 tokens, .* max_model_len \(32\)"):
        processor.process("a", "x" * 32, SamplingParams())
    chat = [{"role": "user", "content": "x" * 100}]
    with pytest.raises(ValueError, match=r"the prompt has 1\d\d tokens"):
        processor.chat_prompt(chat)


def test_a_text_whose_length_proves_it_too_long_is_refused_with_a_lower_bound(
        processor) -> None:
    """No token of the tiny model stands for more characters than its longest added token
    has (16), so a conversation of over 1,000 characters has more tokens than a context of 32
    takes without being tokenized (it has over 1,000: one a byte)."""
    chat = [{"role": "user", "content": "x" * 1000}]
    with pytest.raises(ValueError, match=r"the prompt has at least (\d+) tokens") as refused:
        processor.chat_prompt(chat)
    assert 1000 / 16 <= refused.value.num_tokens <= 1000  # type: ignore[attr-defined]


def test_bad_chat_input_is_rejected(processor) -> None:
    with pytest.raises(ValueError, match="non-empty list"):
        processor.chat_prompt([])
    with pytest.raises(ValueError, match="chat template"):
        processor.chat_prompt([{"role": "user"}, 5])
