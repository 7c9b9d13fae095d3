"""pydantic-ai against the scripted agent's live server, with its OpenAI models on their
defaults (Chat Completions, and Responses re-sending the conversation each turn): a tool loop
of three turns as one job of the engine, four concurrent runs of one prompt as four jobs, and
an oversized prompt's error."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from pydantic_ai import Agent
from pydantic_ai.exceptions import ModelHTTPError
from pydantic_ai.messages import ModelResponse
from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
from pydantic_ai.providers.openai import OpenAIProvider

from tests.compat.jobs import TracedServer, check_one_job, jobs_of
from tests.compat.scripted_agent import ANSWER_PREFIX, TOOL_NAME
from tests.compat.shared import (
    AGENT_MODEL,
    BLOCK_SIZE,
    EXPECTED_ANSWER,
    MAX_TOKENS,
    OVERSIZED_PROMPT,
    PROMPT,
    TWO_CITIES_PROMPT,
    weather_report,
)

MODELS: dict[str, Callable[..., Any]] = {"chat": OpenAIChatModel,
                                         "responses": OpenAIResponsesModel}


def _agent(server: TracedServer, mode: str, calls: list[str]) -> Agent[None, str]:
    """An agent with the weather tool, on `mode`'s OpenAI model of `server`."""
    provider = OpenAIProvider(base_url=server.base_url + "/v1", api_key="unused")
    agent = Agent(MODELS[mode](AGENT_MODEL, provider=provider),
                  instructions="Answer with the weather.",
                  model_settings={"max_tokens": MAX_TOKENS})

    @agent.tool_plain(name=TOOL_NAME)
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return weather_report(city)

    return agent


def _response_ids(result: Any) -> list[str]:
    return [message.provider_response_id for message in result.all_messages()
            if isinstance(message, ModelResponse)]


@pytest.mark.parametrize("mode", MODELS)
def test_a_tool_loop_of_three_turns_is_one_job(agent_server, mode):
    calls: list[str] = []
    result, turns = agent_server.turns(
        lambda: _agent(agent_server, mode, calls).run_sync(TWO_CITIES_PROMPT))
    assert calls == ["Paris", "Rome"]
    assert result.output == ANSWER_PREFIX + weather_report("Rome")
    assert [turn.request_id for turn in turns] == _response_ids(result)
    check_one_job(turns, 3, BLOCK_SIZE)


@pytest.mark.parametrize("mode", MODELS)
def test_four_concurrent_runs_of_one_prompt_are_four_jobs(agent_server, mode):
    agent = _agent(agent_server, mode, [])

    async def four_runs() -> list[Any]:
        return await asyncio.gather(*(agent.run(PROMPT) for _ in range(4)))

    results, turns = agent_server.turns(lambda: asyncio.run(four_runs()))
    assert [result.output for result in results] == [EXPECTED_ANSWER] * 4
    runs = sorted(_response_ids(result) for result in results)
    assert sorted(jobs_of(turns).values()) == runs


@pytest.mark.parametrize(("mode", "param"), [("chat", "messages"), ("responses", "input")])
def test_an_oversized_prompt_is_context_length_exceeded(agent_server, mode, param):
    with pytest.raises(ModelHTTPError) as error:
        _agent(agent_server, mode, []).run_sync(OVERSIZED_PROMPT)
    assert error.value.status_code == 400
    assert (error.value.body["code"], error.value.body["param"]) == (
        "context_length_exceeded", param)
