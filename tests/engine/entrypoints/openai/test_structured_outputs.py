"""Structured outputs over HTTP with the openai SDK, on the random-weight tiny model: whatever
the weights, the constrained output parses and matches its schema."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "mood": {"enum": ["happy", "sad"]},
    },
    "required": ["name", "age", "mood"],
    "additionalProperties": False,
}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"],
        "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
        "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "Tell me about someone."}]


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=150)
    mood: Literal["happy", "sad"]


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_response_format_matches_the_schema(server, seed):
    response = server.client().chat.completions.create(
        model="tiny", messages=MESSAGES, seed=seed, temperature=1.0, max_tokens=80,
        response_format={"type": "json_schema", "json_schema": {
            "name": "person", "schema": PERSON_SCHEMA, "strict": True}},
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON_SCHEMA)


def test_parse_with_a_pydantic_model(server):
    completion = server.client().chat.completions.parse(
        model="tiny", messages=MESSAGES, response_format=Person, seed=7, max_tokens=80)
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person)
    assert person.mood in ("happy", "sad")


def test_json_object_gives_an_object(server):
    response = server.client().chat.completions.create(
        model="tiny", messages=MESSAGES, seed=3, max_tokens=200,
        response_format={"type": "json_object"},
        extra_body={"structured_outputs": None},  # null is "no constraint", not an error
    )
    text = response.choices[0].message.content
    if response.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # an unbounded object may run out of tokens, but never leaves JSON's grammar
        assert text.startswith("{")


def test_streamed_constrained_output_equals_the_whole_one(server):
    body = dict(model="tiny", messages=MESSAGES, seed=11, max_tokens=80,
                response_format={"type": "json_schema", "json_schema": {
                    "name": "person", "schema": PERSON_SCHEMA}})
    whole = server.client().chat.completions.create(**body).choices[0].message.content
    chunks = server.client().chat.completions.create(**body, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks
                       if chunk.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(whole), PERSON_SCHEMA)


@pytest.mark.parametrize(("extra_body", "check"), [
    ({"guided_choice": ["alpha", "beta"]}, lambda text: text in ("alpha", "beta")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda text: text in ("yes", "no")),
    ({"guided_regex": r"[0-9]{3}-[a-c]{2}"},
     lambda text: re.fullmatch(r"[0-9]{3}-[a-c]{2}", text)),
    ({"structured_outputs": {"json": {"type": "array", "items": {"type": "boolean"},
                                      "minItems": 2, "maxItems": 2}}},
     lambda text: [type(item) for item in json.loads(text)] == [bool, bool]),
    ({"guided_grammar": 'start: "x" ("+" "x")*'}, lambda text: re.fullmatch(r"x(\+x)*", text)),
])
def test_completions_take_vllm_constraints(server, extra_body, check):
    for seed in range(3):
        response = server.client().completions.create(
            model="tiny", prompt="Answer:", seed=seed, max_tokens=40, extra_body=extra_body)
        assert response.choices[0].finish_reason == "stop"
        assert check(response.choices[0].text), response.choices[0].text


def _calls(response):
    return [(call.function.name, json.loads(call.function.arguments))
            for call in response.choices[0].message.tool_calls or ()]


def _check_calls(calls):
    tools = {tool["function"]["name"]: tool["function"]["parameters"]
             for tool in (WEATHER_TOOL, TIME_TOOL)}
    for name, arguments in calls:
        jsonschema.validate(arguments, tools[name])


def test_tool_choice_required_makes_valid_calls(server):
    finished = 0
    for seed in range(4):
        response = server.client().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Weather?"}], seed=seed,
            max_tokens=120, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required",
            extra_body={"return_token_ids": True})
        choice = response.choices[0]
        if choice.finish_reason == "length":  # random weights may chain calls past the limit
            assert choice.model_extra["token_ids"][:2] == [259, 10]  # "<tool_call>\n"
            continue
        finished += 1
        calls = _calls(response)
        assert calls and choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        _check_calls(calls)
    assert finished


def test_named_tool_choice_calls_that_tool_once(server):
    for seed in range(3):
        response = server.client().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Time?"}], seed=seed,
            max_tokens=200, tools=[WEATHER_TOOL, TIME_TOOL],
            tool_choice={"type": "function", "function": {"name": "get_time"}})
        ((name, arguments),) = _calls(response)
        assert name == "get_time" and arguments["zone"] in ("utc", "cet")


def test_required_without_parallel_calls_makes_exactly_one(server):
    for seed in range(4):
        response = server.client().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Weather?"}], seed=seed,
            max_tokens=200, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required",
            parallel_tool_calls=False)
        calls = _calls(response)
        assert len(calls) == 1
        _check_calls(calls)


def test_auto_tools_with_a_response_format_give_a_call_or_the_json(server):
    for seed in range(4):
        response = server.client().chat.completions.create(
            model="tiny", messages=MESSAGES, seed=seed, max_tokens=200,
            tools=[TIME_TOOL], response_format={"type": "json_schema", "json_schema": {
                "name": "person", "schema": PERSON_SCHEMA}})
        message = response.choices[0].message
        if message.tool_calls:
            assert _calls(response)[0][0] == "get_time"
        else:
            jsonschema.validate(json.loads(message.content), PERSON_SCHEMA)


def test_a_constraint_with_a_required_tool_choice_is_refused(server):
    with server.http() as http:
        response = http.post("/v1/chat/completions", json={
            "model": "tiny", "messages": MESSAGES, "tools": [TIME_TOOL],
            "tool_choice": "required", "response_format": {"type": "json_object"}})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "response_format"


def test_a_schema_the_grammar_engine_rejects_names_the_field(server):
    with server.http() as http:
        response = http.post("/v1/chat/completions", json={
            "model": "tiny", "messages": MESSAGES, "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
                    "a": {"$ref": "#/$defs/missing"}}}}}})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "response_format.json_schema.schema"
    server.wait_idle()


CRASHING_SCHEMA = {"type": "integer", "minimum": -9223372036854775807,
                   "maximum": -9223372036854775807}  # crashes llguidance 1.9 if it reads it


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": CRASHING_SCHEMA}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"n": CRASHING_SCHEMA}}}}]}, "tools"),
    ("/v1/completions", {"prompt": "n=", "structured_outputs": {
        "grammar": f'start: %json {json.dumps(CRASHING_SCHEMA)}'}}, "structured_outputs"),
])
def test_a_schema_that_would_crash_the_grammar_engine_is_refused(server, path, body, param):
    with server.http() as http:
        response = http.post(path, json={"model": "tiny", "max_tokens": 4, **body})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"].startswith(param)
        assert "leaves no number within the range" in response.json()["error"]["message"]
        assert http.get("/health").status_code == 200


# A schema that names one key and says nothing of others: JSON Schema allows any other key.
OPEN_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}}


def _open_tool(strict: bool | None) -> dict:
    function = {"name": "locate", "parameters": OPEN_PARAMETERS}
    return {"type": "function", "function": function if strict is None
            else {**function, "strict": strict}}


def _named_call_keys(server, strict: bool | None, seed: int) -> set[str]:
    response = server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Where?"}], seed=seed,
        max_tokens=200, tools=[_open_tool(strict)],
        tool_choice={"type": "function", "function": {"name": "locate"}})
    ((_, arguments),) = _calls(response)
    return set(arguments)


def test_a_strict_function_takes_only_its_named_arguments(server):
    seeds = range(6)
    # Not strict: the schema's JSON Schema meaning, which lets the model add keys.
    assert any(_named_call_keys(server, None, seed) - {"city"} for seed in seeds)
    assert all(_named_call_keys(server, True, seed) <= {"city"} for seed in seeds)


def test_a_responses_function_is_strict_unless_it_says_otherwise(server):
    def only_named_keys(seed: int, **strict: bool) -> bool:
        response = server.client().responses.create(
            model="tiny", input="Where?", max_output_tokens=200, store=False,
            tools=[{"type": "function", "name": "locate", "parameters": OPEN_PARAMETERS,
                    **strict}], tool_choice="required", extra_body={"seed": seed})
        calls = [item for item in response.output if item.type == "function_call"]
        keys = set().union(*(json.loads(call.arguments) for call in calls))
        return response.status == "completed" and bool(calls) and keys <= {"city"}
    seeds = range(6)
    assert all(only_named_keys(seed) for seed in seeds)  # OpenAI's default: strict
    # Not strict: the random model runs on emitting keys the schema never named.
    assert not all(only_named_keys(seed, strict=False) for seed in seeds)


def test_a_strict_schema_that_allows_other_keys_is_refused(server):
    allowing = {**OPEN_PARAMETERS, "additionalProperties": True}
    with server.http() as http:
        chat = http.post("/v1/chat/completions", json={
            "model": "tiny", "messages": MESSAGES, "tool_choice": "required",
            "tools": [{"type": "function", "function": {
                "name": "locate", "parameters": allowing, "strict": True}}]})
        formatted = http.post("/v1/chat/completions", json={
            "model": "tiny", "messages": MESSAGES, "response_format": {
                "type": "json_schema", "json_schema": {
                    "name": "x", "schema": allowing, "strict": True}}})
        responses = http.post("/v1/responses", json={
            "model": "tiny", "input": "hi", "tool_choice": "required",
            "tools": [{"type": "function", "name": "locate", "parameters": allowing}]})
    for response, param in ((chat, "tools[0].function.parameters"),
                            (formatted, "response_format.json_schema.schema"),
                            (responses, "tools[0].parameters")):
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and "strict mode forbids" in error["message"]


def test_the_grammar_checker_builds_its_tokenizer_when_prepared_not_when_checking(monkeypatch):
    """The server prepares its one checker at start-up: the tokenizer build holds the GIL,
    so a first constrained request must not make it on a worker thread."""
    import llguidance.hf

    from engine.entrypoints.openai.structured_outputs import GrammarChecker
    from engine.model.tokenizer import load_tokenizer
    from engine.structured_output import grammars

    builds = []
    real = llguidance.hf.from_tokenizer
    monkeypatch.setattr(llguidance.hf, "from_tokenizer",
                        lambda *args, **kwargs: builds.append(1) or real(*args, **kwargs))
    checker = GrammarChecker(load_tokenizer("tiny"))
    checker.prepare()
    assert builds == [1]
    spec = checker.spec("choice", grammars.choice_grammar(["a"]), "structured_outputs")
    assert spec.param == "structured_outputs" and builds == [1]
