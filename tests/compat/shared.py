"""The served model names, pydantic model, tools and checks the suite's modules share.

Fields are bounded (short strings of letters, enums, bounded integers) so that a constrained
output of the random-weight model ends well within `MAX_TOKENS` (the tiny tokenizer spends
one token per byte).
"""

from __future__ import annotations

from typing import Any, Literal

import jsonschema
from pydantic import BaseModel, ConfigDict, Field

from tests.compat.scripted_agent import ANSWER_PREFIX, TOOL_ARGUMENTS

TINY_MODEL = "tiny"  # the served name of the tiny model's server
AGENT_MODEL = "scripted-agent"  # the served name of the scripted agent's server
AGENT_EXECUTOR = "tests.compat.scripted_agent:ToolThenAnswerExecutor"
MAX_TOKENS = 120
MAX_MODEL_LEN = 1024  # tokens: a prompt of more bytes exceeds the context
BLOCK_SIZE = 16
PROMPT = "What is the weather like?"
TWO_CITIES_PROMPT = "What is the weather in Paris, and in Rome?"  # a tool loop of three turns
OVERSIZED_PROMPT = "weather " * (MAX_MODEL_LEN // 4)


class Forecast(BaseModel):
    """A structured answer: each field bounded and no other field allowed, so its JSON is
    at most ~60 bytes."""

    model_config = ConfigDict(extra="forbid")
    city: str = Field(min_length=1, max_length=8, pattern=r"^[A-Za-z]+$")
    sky: Literal["sunny", "cloudy", "rainy"]
    celsius: int = Field(ge=-30, le=45)


def check_forecast(value: Any) -> Forecast:
    """`value` is a `Forecast` that meets every constraint of its fields."""
    assert isinstance(value, Forecast), value
    jsonschema.validate(value.model_dump(), Forecast.model_json_schema())
    return value


WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 8,
                            "pattern": "^[A-Za-z]+$"},
                   "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMETERS = {
    "type": "object",
    "properties": {"zone": {"enum": ["utc", "cet"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
CHAT_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER_PARAMETERS}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a zone",
                                      "parameters": TIME_PARAMETERS}},
]
PARAMETERS_BY_TOOL = {tool["function"]["name"]: tool["function"]["parameters"]
                      for tool in CHAT_TOOLS}


def check_call(name: str, arguments: dict[str, Any]) -> None:
    """A call of one of `CHAT_TOOLS` whose arguments match that tool's schema."""
    assert name in PARAMETERS_BY_TOOL, name
    jsonschema.validate(arguments, PARAMETERS_BY_TOOL[name])


def weather_report(city: str) -> str:
    """What the suite's weather tool returns for `city` (the scripted model echoes it)."""
    return f"sunny in {city}"


EXPECTED_ANSWER = ANSWER_PREFIX + weather_report(TOOL_ARGUMENTS["city"])
