"""/v1/chat/completions through the openai SDK against a real server on the tiny model."""

from __future__ import annotations

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


def test_chat_completion(server):
    response = server.client().chat.completions.create(
        model="tiny", messages=MESSAGES, temperature=0.0, max_completion_tokens=10,
    )
    (choice,) = response.choices
    assert response.object == "chat.completion"
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.message.tool_calls is None
    assert response.usage.completion_tokens == 10
    assert choice.finish_reason == "length"


def test_chat_stream_matches_the_whole_response(server):
    client = server.client()
    kwargs = {"model": "tiny", "messages": MESSAGES, "temperature": 0.0, "max_tokens": 10}
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10
    # As OpenAI documents: every other chunk carries a null usage.
    assert all("usage" in c.model_fields_set and c.usage is None for c in chunks[:-1])


def test_chat_n_streams_every_choice(server):
    chunks = list(server.client().chat.completions.create(
        model="tiny", messages=MESSAGES, n=2, seed=7, max_tokens=5, stream=True))
    finished = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}


def test_chat_logprobs(server):
    response = server.client().chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=6, logprobs=True, top_logprobs=2,
        extra_body={"ignore_eos": True},  # random weights may sample EOS before 6 tokens
    )
    content = response.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert entry.logprob <= 0.0
        assert len(entry.top_logprobs) == 2
        if "\ufffd" not in entry.token:  # else part of a character: its bytes are its own
            assert entry.bytes == list(entry.token.encode())


def test_logprob_bytes_rebuild_characters_that_span_tokens(server):
    """The tiny vocabulary writes a byte a token: each of these characters spans several,
    which decode alone to U+FFFD; their bytes put together are the text."""
    response = server.client().chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=12, logprobs=True,
        extra_body={"structured_outputs": {"regex": "😀中"}})
    content = response.choices[0].logprobs.content
    assert response.choices[0].message.content == "😀中"
    assert "\ufffd" in content[0].token
    assert bytes(b for entry in content for b in entry.bytes).startswith("😀中".encode())


def test_return_token_ids_in_chat(server):
    response = server.client().chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=4,
        extra_body={"return_token_ids": True, "ignore_eos": True})
    assert len(response.model_extra["prompt_token_ids"]) == response.usage.prompt_tokens
    assert len(response.choices[0].model_extra["token_ids"]) == 4


def test_conversation_with_an_earlier_tool_call(server):
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "list files"}]},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "bash", "arguments": '{"command": "ls"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "a.txt"},
    ]
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}}}}}]
    response = server.client().chat.completions.create(
        model="tiny", messages=messages, tools=tools, max_tokens=4)
    assert response.usage.prompt_tokens > 50
