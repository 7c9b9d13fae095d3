"""`echo` with prompt logprobs (the loglikelihood path of evaluation harnesses) and
`logit_bias`, through the openai SDK against real servers on the tiny model."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.engine.entrypoints.openai.conftest import ServerThread, start_server

PROMPT = "The quick brown fox jumps over"
ATOL = 1e-3


@pytest.fixture(scope="module")
def chunked_server() -> Iterator[ServerThread]:
    """A server whose prompts are prefilled 8 tokens per step."""
    running = start_server(long_prefill_token_threshold=8)
    yield running
    running.stop()


def check_offsets(logprobs, text: str) -> None:
    """The token texts spell the text, and each offset is where its token starts."""
    assert "".join(logprobs.tokens) == text
    starts = [sum(len(token) for token in logprobs.tokens[:i])
              for i in range(len(logprobs.tokens))]
    assert logprobs.text_offset == starts


def test_echo_logprobs_are_the_logprobs_of_each_token_forced_as_the_next(server):
    """Scores the prompt with echo and max_tokens 0, then generates each prompt token after
    the tokens before it (forced with logit_bias, whose logprobs stay the model's own): the
    prompt logprob of token i is the logprob the model gives it as the next token."""
    client = server.client()
    token_ids = server.engine.tokenizer(PROMPT).input_ids
    scored = client.completions.create(model="tiny", prompt=PROMPT, echo=True, max_tokens=0,
                                       logprobs=2, temperature=0.0)
    choice, = scored.choices
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert scored.usage.completion_tokens == 0
    assert scored.usage.prompt_tokens == len(token_ids)
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(token_ids)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    check_offsets(logprobs, PROMPT)
    for i in range(1, len(token_ids)):
        forced = client.completions.create(
            model="tiny", prompt=token_ids[:i], max_tokens=1, temperature=0.0, logprobs=2,
            logit_bias={str(token_ids[i]): 100}, extra_body={"return_token_ids": True},
        ).choices[0]
        assert forced.token_ids == [token_ids[i]]
        assert forced.logprobs.tokens == [logprobs.tokens[i]]
        expected = forced.logprobs.token_logprobs[0]
        assert logprobs.token_logprobs[i] == pytest.approx(expected, abs=ATOL)
        assert logprobs.top_logprobs[i].keys() == forced.logprobs.top_logprobs[0].keys()
        assert logprobs.top_logprobs[i][logprobs.tokens[i]] == pytest.approx(expected, abs=ATOL)
    assert sum(logprobs.token_logprobs[1:]) < 0
    server.wait_idle()


def test_echo_with_a_completion_and_a_prompt_prefilled_in_chunks(server, chunked_server):
    """A prompt prefilled in several steps gets the same prompt logprobs as one prefilled at
    once; the generated tokens follow the prompt in text and logprobs."""
    prompt = PROMPT * 3
    kwargs = {"model": "tiny", "prompt": prompt, "echo": True, "logprobs": 1,
              "max_tokens": 5, "temperature": 0.0}
    chunked = chunked_server.client().completions.create(**kwargs).choices[0]
    whole = server.client().completions.create(**kwargs).choices[0]
    plain = chunked_server.client().completions.create(
        **{**kwargs, "echo": False}).choices[0]
    num_prompt_tokens = len(chunked_server.engine.tokenizer(prompt).input_ids)
    assert num_prompt_tokens > 24  # at least four prefill steps
    assert chunked.text == prompt + plain.text == whole.text
    assert len(chunked.logprobs.tokens) == num_prompt_tokens + 5
    assert chunked.logprobs.tokens[num_prompt_tokens:] == plain.logprobs.tokens
    assert chunked.logprobs.token_logprobs[num_prompt_tokens:] == pytest.approx(
        plain.logprobs.token_logprobs, abs=ATOL)
    assert chunked.logprobs.token_logprobs[0] is None
    assert chunked.logprobs.token_logprobs[1:] == pytest.approx(
        whole.logprobs.token_logprobs[1:], abs=ATOL)
    check_offsets(chunked.logprobs, chunked.text)
    chunked_server.wait_idle()


def test_a_prompt_in_the_prefix_cache_is_still_scored_in_full(server):
    client = server.client()
    prompt = "A prompt that the prefix cache holds after the first request"
    client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
    cached = client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
    assert cached.usage.prompt_tokens_details.cached_tokens > 0
    first = client.completions.create(model="tiny", prompt=prompt, echo=True, max_tokens=0,
                                      logprobs=0)
    again = client.completions.create(model="tiny", prompt=prompt, echo=True, max_tokens=0,
                                      logprobs=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert len(first.choices[0].logprobs.tokens) == first.usage.prompt_tokens
    assert first.choices[0].logprobs.token_logprobs == again.choices[0].logprobs.token_logprobs


def test_streamed_echo_sends_the_prompt_first(chunked_server):
    client = chunked_server.client()
    prompt = PROMPT * 2
    kwargs = {"model": "tiny", "prompt": prompt, "echo": True, "logprobs": 1,
              "max_tokens": 6, "temperature": 0.0}
    whole = client.completions.create(**kwargs).choices[0]
    chunks = [chunk.choices[0] for chunk in client.completions.create(**kwargs, stream=True)]
    assert chunks[0].text.startswith(prompt)
    num_prompt_tokens = len(chunked_server.engine.tokenizer(prompt).input_ids)
    assert len(chunks[0].logprobs.tokens) >= num_prompt_tokens
    assert "".join(chunk.text for chunk in chunks) == whole.text
    tokens = [token for chunk in chunks for token in chunk.logprobs.tokens]
    offsets = [offset for chunk in chunks for offset in chunk.logprobs.text_offset]
    token_logprobs = [lp for chunk in chunks for lp in chunk.logprobs.token_logprobs]
    assert tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset
    assert token_logprobs[0] is None
    assert token_logprobs[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=ATOL)
    only_prompt = list(client.completions.create(**{**kwargs, "max_tokens": 0}, stream=True))
    assert [chunk.choices[0].text for chunk in only_prompt] == [prompt]
    assert only_prompt[0].choices[0].finish_reason == "length"
    assert len(only_prompt[0].choices[0].logprobs.tokens) == num_prompt_tokens
    chunked_server.wait_idle()


def test_echo_of_token_id_prompts_in_a_batch_with_n(server):
    tokenizer = server.engine.tokenizer
    prompts = [tokenizer("Hello there").input_ids, tokenizer("<|im_start|>user").input_ids]
    response = server.client().completions.create(
        model="tiny", prompt=prompts, n=2, echo=True, logprobs=0, max_tokens=3,
        temperature=1.0, seed=7,
        extra_body={"skip_special_tokens": False, "ignore_eos": True},
    )
    assert [choice.index for choice in response.choices] == [0, 1, 2, 3]
    for choice in response.choices:
        prompt_ids = prompts[choice.index // 2]
        echoed = tokenizer.decode(prompt_ids)
        assert choice.text.startswith(echoed)
        logprobs = choice.logprobs
        assert len(logprobs.tokens) == len(prompt_ids) + 3
        assert all(len(top) == 1 for top in logprobs.top_logprobs[1:])  # logprobs=0: its own
        check_offsets(logprobs, choice.text)
    for first, second in (response.choices[:2], response.choices[2:]):
        num_prompt = len(prompts[first.index // 2])
        assert (first.logprobs.token_logprobs[:num_prompt]
                == second.logprobs.token_logprobs[:num_prompt])
    assert response.usage.completion_tokens == 12
    server.wait_idle()


def test_echo_without_logprobs_returns_the_prompt_and_the_completion(server):
    client = server.client()
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4,
                                      temperature=0.0).choices[0]
    echoed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4,
                                       temperature=0.0, echo=True).choices[0]
    assert echoed.text == PROMPT + plain.text and echoed.logprobs is None


def test_logit_bias_forces_and_bans_tokens(server):
    client = server.client()
    z = server.engine.tokenizer.convert_tokens_to_ids("z")
    forced = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5,
                                       temperature=0.0, logit_bias={str(z): 100})
    assert forced.choices[0].text == "zzzzz"
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1,
                                      temperature=0.0, extra_body={"return_token_ids": True})
    greedy = plain.choices[0].token_ids[0]
    banned = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=1, temperature=0.0,
        logit_bias={str(greedy): -100}, extra_body={"return_token_ids": True})
    assert banned.choices[0].token_ids[0] != greedy
    sampled = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8,
                                        temperature=1.0, seed=3, logit_bias={str(z): 100})
    assert sampled.choices[0].text == "z" * 8


def test_logit_bias_on_chat_completions(server):
    z = server.engine.tokenizer.convert_tokens_to_ids("z")
    response = server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        temperature=0.0, logit_bias={str(z): 100})
    assert response.choices[0].message.content == "zzzz"
