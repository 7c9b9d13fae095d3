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
