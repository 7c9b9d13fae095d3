"""Policy options: `KEY=VALUE` settings the engine carries without interpreting them.

A policy owns its options: it declares them as a frozen dataclass whose fields have defaults
and the engine's `setting` metadata (group "policy", no flag of their own), and
`parse_options` builds that dataclass from what the engine carries (text from
`--policy-option KEY=VALUE` flags, typed values from a config file's `[policy_options]` table
or `LLM(...)` keywords), rejecting unknown keys and bad values with an error naming them.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, Literal, TypeVar

T = TypeVar("T")

_NONE_WORDS = ("none", "null")
_TRUE_WORDS = ("true", "1", "yes", "on")
_FALSE_WORDS = ("false", "0", "no", "off")


def option_items_to_dict(items: Iterable[str]) -> dict[str, str]:
    """`["a=1", "b=x"]` -> `{"a": "1", "b": "x"}`; ValueError for an item without `=`, an
    empty key, or a key given twice."""
    options: dict[str, str] = {}
    for item in items:
        key, separator, value = item.partition("=")
        key = key.strip()
        if not separator or not key:
            raise ValueError(f"a policy option must be KEY=VALUE, got {item!r}")
        if key in options:
            raise ValueError(f"policy option {key!r} is given twice")
        options[key] = value.strip()
    return options


def parse_options(config_type: type[T], options: Mapping[str, object], *, owner: str) -> T:
    """The `config_type` dataclass with `options` applied over its defaults. Keys are field
    names (dashes may stand for underscores); values are strings converted by the field's
    type (`bool`, `int`, `float`, `str`, a `Literal`, `X | None`, `tuple[str, ...]` as a
    comma-separated list) or values of that type already. ValueError naming `owner`, the key
    and what it accepts; the dataclass's own checks run last."""
    fields = {field.name: field for field in dataclasses.fields(config_type)}  # type: ignore[arg-type]
    hints = typing.get_type_hints(config_type)
    values: dict[str, Any] = {}
    for raw_key, raw_value in options.items():
        key = str(raw_key).strip().replace("-", "_")
        if key not in fields:
            known = ", ".join(sorted(fields)) or "none"
            raise ValueError(f"unknown option {raw_key!r} for {owner}; its options: {known}")
        try:
            values[key] = _convert(hints[key], raw_value)
        except ValueError as error:
            raise ValueError(f"option {key} of {owner}: {error}") from None
    try:
        return config_type(**values)
    except (TypeError, ValueError) as error:
        raise ValueError(f"options of {owner}: {error}") from None


def parse_policy_options(options_type: type[T] | None, options: Mapping[str, object], *,
                         owner: str) -> T | None:
    """`parse_options` for a policy's `options_type`; None for a policy that has none, which
    refuses any option (ValueError)."""
    if options_type is None:
        if options:
            raise ValueError(f"{owner} takes no options; got {', '.join(map(str, options))}")
        return None
    return parse_options(options_type, options, owner=owner)


def describe_options(config_type: type) -> list[str]:
    """One line per option: `name=default: help`."""
    lines = []
    for field in dataclasses.fields(config_type):
        default = field.default
        if default is dataclasses.MISSING and field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        lines.append(f"{field.name}={_format(default)}: {field.metadata.get('help', '')}")
    return lines


def _format(value: object) -> str:
    if value is None:
        return "none"
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value).lower() if isinstance(value, bool) else str(value)


def _convert(annotation: Any, value: object) -> Any:
    origin = typing.get_origin(annotation)
    arguments = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        members = [a for a in arguments if a is not type(None)]
        is_none = value is None or (isinstance(value, str)
                                    and value.strip().lower() in _NONE_WORDS)
        if is_none and len(members) < len(arguments):
            return None
        if len(members) == 1:
            return _convert(members[0], value)
        raise ValueError(f"unsupported option type {annotation!r}")
    if origin is Literal:
        text = value if isinstance(value, str) else str(value)
        if text not in arguments:
            raise ValueError(f"expected one of {', '.join(map(str, arguments))}, got {value!r}")
        return text
    if origin is tuple:
        items = value.split(",") if isinstance(value, str) else list(value)  # type: ignore[call-overload]
        return tuple(str(item).strip() for item in items if str(item).strip())
    if annotation is bool:
        return _bool(value)
    if annotation in (int, float):
        return _number(annotation, value)
    if annotation is str:
        if not isinstance(value, str):
            raise ValueError(f"expected a string, got {value!r}")
        return value
    raise ValueError(f"unsupported option type {annotation!r}")


def _bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE_WORDS:
        return True
    if text in _FALSE_WORDS:
        return False
    raise ValueError(f"expected true or false, got {value!r}")


def _number(kind: type, value: object) -> int | float:
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {value!r}")
    try:
        number = kind(value.strip() if isinstance(value, str) else value)  # type: ignore[call-arg]
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"expected {'an integer' if kind is int else 'a number'}, "
                         f"got {value!r}") from None
    if isinstance(number, float) and math.isnan(number):
        raise ValueError(f"expected a number, got {value!r}")
    return number
