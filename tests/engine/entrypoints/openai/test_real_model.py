"""The real model `smollm2-135m-instruct` (SmolLM2-135M-Instruct, fetched by `continuum models
pull`, which `scripts/setup.sh` runs) served over HTTP: greedy parity with transformers, its own
chat template, an agent loop with a tool over the `openai` SDK whose second turn is served from
its pin, and a strict `json_schema` answer that parses.

Without the model in the cache these tests skip, except under `CI=true`, where they fail: CI's
set-up fetches the model, so a missing one there is a broken set-up, not an optional test.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from engine.entrypoints.openai.serving import ServerSettings
from tests.engine.entrypoints.openai.conftest import MAX_BODY_BYTES, ServerThread, start_server
from tests.engine.model.real_model import REAL_MODEL, require_real_model

MODEL = REAL_MODEL
BLOCK_SIZE = 16
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]},
}}


@pytest.fixture(scope="module")
def checkout() -> Any:
    return require_real_model()


@pytest.fixture(scope="module")
def server(checkout) -> Iterator[ServerThread]:
    """The real model under the default policy, pinning a tool call's KV for 2 s; a 512-token
    step budget keeps the start-up prefill profile short on a CPU."""
    server = start_server(
        model=MODEL, max_model_len=2048, max_num_batched_tokens=512,
        policy_options={"estimator": "fixed-2s"},
        settings=ServerSettings(served_model_name=MODEL, max_request_body_bytes=MAX_BODY_BYTES))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference(checkout) -> tuple[Any, Any]:
    """transformers' own tokenizer and model of the same checkout."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(checkout)
    model = transformers.AutoModelForCausalLM.from_pretrained(checkout).eval()
    return tokenizer, model


def test_greedy_completions_are_token_identical_to_transformers(server, reference):
    import torch

    tokenizer, model = reference
    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
    client = server.client()
    for prompt in prompts:
        served = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16,
                                           temperature=0, extra_body={"return_token_ids": True})
        input_ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            expected = model.generate(input_ids, max_new_tokens=16, do_sample=False,
                                      eos_token_id=None)[0, input_ids.shape[1]:].tolist()
        assert served.choices[0].model_extra["token_ids"] == expected, prompt


def test_a_chat_is_rendered_by_the_models_own_template_and_answered(server, reference):
    tokenizer, _ = reference
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = server.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0,
        extra_body={"return_token_ids": True})
    expected_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                    tokenize=False)
    assert expected_prompt.startswith("<|im_start|>system\n")  # SmolLM2's ChatML template
    assert reply.model_extra["prompt_token_ids"] == tokenizer(
        expected_prompt, add_special_tokens=False).input_ids
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"  # <|im_end|> ends the turn


def test_an_agent_calls_its_tool_and_its_next_turn_is_served_from_the_pin(server):
    client = server.client()
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "What is the weather in Paris?"}]
    reused_before = server.metric("pins_released_total", 'reason="reused"')
    first = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER_TOOL], max_tokens=48, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        extra_body={"job_id": "weather-agent"})
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    with server.http() as http:
        pin = http.get("/v1/jobs/weather-agent").json()["pin"]
    assert pin["num_blocks"] >= 1

    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    second = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER_TOOL], max_tokens=48, temperature=0,
        extra_body={"job_id": "weather-agent", "is_last_step": True})
    first_prompt_blocks = first.usage.prompt_tokens // BLOCK_SIZE
    assert second.usage.prompt_tokens_details.cached_tokens >= first_prompt_blocks * BLOCK_SIZE
    assert server.metric("pins_released_total", 'reason="reused"') == reused_before + 1
    answer = second.choices[0].message.content
    assert second.choices[0].finish_reason == "stop" and "21" in answer
    server.wait_idle()


def test_a_strict_json_schema_answer_parses_and_its_numbers_end(server):
    schema = {"type": "object", "additionalProperties": False,
              "required": ["city", "population_millions"],
              "properties": {"city": {"type": "string"},
                             "population_millions": {"type": "number"}}}
    reply = server.client().chat.completions.create(
        model=MODEL, max_tokens=96, temperature=0,
        messages=[{"role": "user", "content": "Name the largest city of France and its "
                                              "population in millions, as JSON."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "city", "schema": schema, "strict": True}})
    assert reply.choices[0].finish_reason == "stop"
    answer = json.loads(reply.choices[0].message.content)
    jsonschema.validate(answer, schema)
    fraction = str(answer["population_millions"]).partition(".")[2]
    assert len(fraction) <= 9


def test_the_shipped_config_has_the_real_models_shapes(checkout):
    from engine.model.arch import ModelArch
    from engine.model.configs import CONFIGS_DIR
    from engine.model.directory import load_arch

    shipped = json.loads((CONFIGS_DIR / "smollm2-135m-instruct.json").read_text())
    assert ModelArch.from_hf_config(shipped) == load_arch(MODEL)
