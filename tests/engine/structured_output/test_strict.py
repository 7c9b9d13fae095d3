"""OpenAI's strict mode: a strict schema's objects take only the properties they name."""

from __future__ import annotations

import copy
import json

import pytest

from engine.structured_output import grammars
from engine.structured_output.strict import strict_schema
from tests.engine.structured_output.matching import accepts

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def test_every_object_takes_only_its_named_properties() -> None:
    schema = {
        "type": "object",
        "properties": {
            "place": {"$ref": "#/$defs/place"},
            "tags": {"type": "array", "items": {"properties": {"k": {"type": "string"}}}},
            "either": {"anyOf": [{"type": "object", "properties": {}}, {"type": "null"}]},
            "size": {"type": "integer"},
        },
        "$defs": {"place": {"type": ["object", "null"], "properties": {"x": {"type": "number"}},
                            "additionalProperties": False}},
    }
    before = copy.deepcopy(schema)
    strict = strict_schema(schema)
    assert schema == before  # the client's schema is not changed
    assert strict["additionalProperties"] is False
    assert strict["properties"]["tags"]["items"]["additionalProperties"] is False
    assert strict["properties"]["either"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in strict["properties"]["either"]["anyOf"][1]
    assert "additionalProperties" not in strict["properties"]["size"]
    assert strict["$defs"]["place"]["additionalProperties"] is False
    assert strict_schema({"type": "string"}) == {"type": "string"}


@pytest.mark.parametrize("allowed", [True, {"type": "string"}])
def test_a_strict_schema_that_allows_other_keys_is_refused(allowed: object) -> None:
    schema = {"type": "object", "properties": {"inner": {**CITY,
                                                         "additionalProperties": allowed}}}
    with pytest.raises(ValueError, match=r"schema\.properties\.inner allows properties"):
        strict_schema(schema)


def test_the_grammar_of_a_strict_schema_refuses_unnamed_keys(tokenizer) -> None:
    plain = grammars.json_schema_grammar(CITY)
    strict = grammars.json_schema_grammar(strict_schema(CITY))
    extra = json.dumps({"city": "Paris", "location": "Europe"})
    named = json.dumps({"city": "Paris"})
    assert accepts(tokenizer, plain, extra) and accepts(tokenizer, plain, named)
    assert not accepts(tokenizer, strict, extra) and accepts(tokenizer, strict, named)


def test_strict_numbers_get_length_bounds_on_the_sides_the_schema_leaves_open() -> None:
    schema = {"type": "object", "properties": {
        "any": {"type": "number"},
        "count": {"type": "integer", "minimum": 0},
        "share": {"type": ["number", "null"], "exclusiveMaximum": 1, "multipleOf": 0.25},
        "name": {"type": "string"},
    }}
    properties = strict_schema(schema)["properties"]
    assert properties["any"] == {"type": "number", "maximum": 999_999_999_999_999,
                                 "minimum": -999_999_999_999_999, "multipleOf": 1e-9}
    assert properties["count"] == {"type": "integer", "minimum": 0,
                                   "maximum": 999_999_999_999_999}
    assert properties["share"] == {"type": ["number", "null"], "exclusiveMaximum": 1,
                                   "multipleOf": 0.25, "minimum": -999_999_999_999_999}
    assert properties["name"] == {"type": "string"}


def test_a_strict_number_stops_after_15_integer_and_9_fraction_digits(tokenizer) -> None:
    schema = {"type": "object", "properties": {"population_millions": {"type": "number"}},
              "required": ["population_millions"]}
    plain = grammars.json_schema_grammar(schema)
    strict = grammars.json_schema_grammar(strict_schema(schema))

    def value(number: str) -> str:
        return '{"population_millions": ' + number + "}"

    for number in ("2.1", "-48.856613", "999999999999999", "0.123456789"):
        assert accepts(tokenizer, strict, value(number)), number
    for number in ("3121222231234444", "0.1234567891"):
        assert accepts(tokenizer, plain, value(number))
        assert not accepts(tokenizer, strict, value(number)), number


def test_a_schema_widens_the_number_bounds_by_stating_its_own(tokenizer) -> None:
    schema = {"type": "number", "maximum": 1e17, "minimum": -1e17, "multipleOf": 1e-10}
    strict = grammars.json_schema_grammar(strict_schema(schema))
    assert accepts(tokenizer, strict, "31212222312344440")
    assert accepts(tokenizer, strict, "-0.1234567891")


@pytest.mark.parametrize("schema", [
    {"type": "integer", "minimum": 1e16},
    {"type": "number", "exclusiveMinimum": 1e15},
    {"type": "number", "maximum": -1e16},
    {"type": "number", "enum": [1e16, 2]},
    {"type": "number", "const": 0.1234567891},
])
def test_number_bounds_never_leave_a_schema_without_values(schema, tokenizer) -> None:
    strict = strict_schema(schema)
    grammars.check_grammar(grammars.json_schema_grammar(strict), tokenizer[1])
    assert {key: strict[key] for key in schema} == schema
    if "enum" in schema or "const" in schema:
        assert strict == schema
