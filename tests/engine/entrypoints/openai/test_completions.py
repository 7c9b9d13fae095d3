"""/v1/completions through the openai SDK against a real server on the tiny model."""

from __future__ import annotations

import pytest

GREEDY = {"temperature": 0.0, "max_tokens": 12}


def test_text_prompt_reports_text_usage_and_finish_reason(server):
    response = server.client().completions.create(model="tiny", prompt="Hello", **GREEDY)
    (choice,) = response.choices
    assert response.object == "text_completion"
    assert response.id.startswith("cmpl-")
    assert choice.finish_reason == "length"
    assert isinstance(choice.text, str)
    assert response.usage.completion_tokens == 12
    assert response.usage.prompt_tokens > 0
    assert response.usage.total_tokens == response.usage.prompt_tokens + 12
    assert response.usage.prompt_tokens_details.cached_tokens >= 0


def test_token_id_prompt_with_return_token_ids(server):
    client = server.client()
    text = client.completions.create(model="tiny", prompt="Hello", **GREEDY)
    prompt_ids = server.engine.tokenizer("Hello").input_ids
    by_ids = client.completions.create(model="tiny", prompt=prompt_ids, **GREEDY,
                                       extra_body={"return_token_ids": True})
    choice = by_ids.choices[0]
    assert choice.text == text.choices[0].text
    assert choice.prompt_token_ids == prompt_ids
    assert len(choice.token_ids) == 12


def test_batch_of_prompts_with_n_indexes_choices(server):
    response = server.client().completions.create(
        model="tiny", prompt=["Hello", "World"], n=2, temperature=1.0, seed=3, max_tokens=4,
    )
    assert sorted(choice.index for choice in response.choices) == [0, 1, 2, 3]
    assert response.usage.completion_tokens == 16


def test_seed_reproduces_and_completions_of_n_differ(server):
    client = server.client()
    kwargs = {"model": "tiny", "prompt": "Once upon", "n": 3, "temperature": 1.0,
              "max_tokens": 16, "seed": 1234}
    first = [choice.text for choice in client.completions.create(**kwargs).choices]
    second = [choice.text for choice in client.completions.create(**kwargs).choices]
    assert first == second
    assert len(set(first)) > 1


def test_stop_string_cuts_the_text(server):
    client = server.client()
    full = client.completions.create(model="tiny", prompt="The", temperature=0.0,
                                     max_tokens=24).choices[0].text
    stop = next(full[k:k + 2] for k in range(1, len(full) - 2)
                if "\ufffd" not in full[k:k + 2])
    stopped = client.completions.create(model="tiny", prompt="The", temperature=0.0,
                                        max_tokens=24, stop=[stop]).choices[0]
    assert stopped.text == full[:full.find(stop)]
    assert stopped.finish_reason == "stop"
    assert stopped.model_extra["stop_reason"] == stop


def test_logprobs(server):
    response = server.client().completions.create(model="tiny", prompt="Hello", logprobs=3,
                                                  **GREEDY)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 12
    assert all(lp <= 0.0 for lp in logprobs.token_logprobs)
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs,
                                   logprobs.top_logprobs, strict=True):
        assert 1 <= len(top) <= 4
        # Greedy: the sampled token is the most likely one.
        assert logprob == pytest.approx(max(top.values()), abs=1e-5)
        if "\ufffd" not in token:  # byte tokens that are no text on their own share a key
            assert top[token] == pytest.approx(logprob)
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_stream_matches_the_whole_response_and_ends_with_usage(server):
    client = server.client()
    whole = client.completions.create(model="tiny", prompt="Hello", **GREEDY)
    chunks = list(client.completions.create(
        model="tiny", prompt="Hello", stream=True, stream_options={"include_usage": True},
        **GREEDY,
    ))
    text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    assert text == whole.choices[0].text
    finish = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices]
    assert finish[-1] == "length" and set(finish[:-1]) <= {None}
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all("usage" in c.model_fields_set and c.usage is None for c in chunks[:-1])


def test_repeated_prompt_reports_cached_tokens(server):
    client = server.client()
    prompt = list(range(100, 180))  # five full blocks
    client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens == 64
