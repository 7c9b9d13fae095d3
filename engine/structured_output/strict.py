"""OpenAI's strict mode for JSON schemas: an object takes only the properties it names.

OpenAI guarantees, for a schema sent with `strict: true` (a `json_schema` response format, or
a function tool's parameters), that the output has no key the schema does not name. Plain
JSON Schema allows any other key unless `additionalProperties` is false, so a strict schema is
rewritten with `additionalProperties: false` on every object schema that does not say it; one
that allows other keys (`additionalProperties` true or a schema) is refused, as OpenAI refuses
it. Non-strict schemas keep their JSON Schema meaning.

Strict mode also bounds the length of numbers, so that a weak model cannot emit digits until
`max_tokens` (seen with SmolLM2-135M: `"population_millions": 3121222231234444...`): a number
or integer schema without a bound on a side gets one at +-(10^15 - 1) (15 digits, the most
that every double keeps exactly in decimal), and a number schema without `multipleOf` takes at
most 9 fraction digits (`multipleOf` 1e-9). A schema widens either bound by stating its own
(`maximum`, `minimum`, their exclusive forms, `multipleOf`); one that lists its values
(`const`, `enum`) is left as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Keywords whose value is one subschema, a list of them, or a name -> subschema map.
_ONE = ("items", "not", "if", "then", "else", "contains", "additionalItems")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")

MAX_INTEGER_DIGITS = 15
MAX_FRACTION_DIGITS = 9
_LARGEST_NUMBER = 10**MAX_INTEGER_DIGITS - 1


def strict_schema(schema: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `schema` in which every object schema takes only its named properties;
    ValueError naming the place where a subschema allows other keys."""
    return _strict(schema, "schema")


def _strict(node: Mapping[str, Any], where: str) -> dict[str, Any]:
    strict = dict(node)
    for key in _ONE:
        value = node.get(key)
        if isinstance(value, Mapping):
            strict[key] = _strict(value, f"{where}.{key}")
        elif isinstance(value, list):  # items as a list (draft 4 tuples)
            strict[key] = _strict_list(value, f"{where}.{key}")
    for key in _LIST:
        if isinstance(node.get(key), list):
            strict[key] = _strict_list(node[key], f"{where}.{key}")
    for key in _MAP:
        value = node.get(key)
        if isinstance(value, Mapping):
            strict[key] = {name: _strict(sub, f"{where}.{key}.{name}")
                           if isinstance(sub, Mapping) else sub for name, sub in value.items()}
    if _is_object(node):
        allowed = node.get("additionalProperties", False)
        if allowed is not False:
            raise ValueError(f"{where} allows properties it does not name "
                             f"(additionalProperties: {allowed!r}), which strict mode forbids; "
                             "set additionalProperties to false or strict to false")
        strict["additionalProperties"] = False
    strict.update(_number_bounds(node))
    return strict


def _number_bounds(node: Mapping[str, Any]) -> dict[str, Any]:
    """The length bounds a number or integer schema lacks: none for other schemas, for one
    whose values are listed (`const`, `enum`), and on a side where the schema's other bound
    lies beyond ours (it asks for longer numbers; ours would leave none)."""
    kinds = _types(node)
    if not kinds & {"number", "integer"} or "const" in node or "enum" in node:
        return {}
    lowest, highest = _stated_bound(node, "minimum"), _stated_bound(node, "maximum")
    bounds: dict[str, Any] = {}
    if highest is None and (lowest is None or lowest < _LARGEST_NUMBER):
        bounds["maximum"] = _LARGEST_NUMBER
    if lowest is None and (highest is None or highest > -_LARGEST_NUMBER):
        bounds["minimum"] = -_LARGEST_NUMBER
    if "number" in kinds and "multipleOf" not in node:
        bounds["multipleOf"] = 10.0**-MAX_FRACTION_DIGITS
    return bounds


def _stated_bound(node: Mapping[str, Any], side: str) -> float | None:
    """The schema's bound on one side (`minimum` or `maximum`, inclusive or exclusive)."""
    exclusive = "exclusive" + side[0].upper() + side[1:]
    values = [node[key] for key in (side, exclusive)
              if isinstance(node.get(key), (int, float)) and not isinstance(node[key], bool)]
    if not values:
        return None
    return max(values) if side == "minimum" else min(values)


def _strict_list(values: list[Any], where: str) -> list[Any]:
    return [_strict(sub, f"{where}[{index}]") if isinstance(sub, Mapping) else sub
            for index, sub in enumerate(values)]


def _types(node: Mapping[str, Any]) -> set[str]:
    kind = node.get("type")
    if isinstance(kind, str):
        return {kind}
    return {name for name in kind if isinstance(name, str)} if isinstance(kind, list) else set()


def _is_object(node: Mapping[str, Any]) -> bool:
    return "object" in _types(node) or ("type" not in node and "properties" in node)
