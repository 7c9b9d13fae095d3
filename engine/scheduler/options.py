"""Policy options: `KEY=VALUE` settings the engine carries without interpreting them.

A policy owns its options: it declares them as a frozen dataclass whose fields have defaults
and the engine's `setting` metadata (group "policy", no flag of their own), and
`parse_options` builds that dataclass from what the engine carries (text from
`--policy-option KEY=VALUE` flags, typed values from a config file's `[policy_options]` table
or `LLM(...)` keywords), rejecting unknown keys and bad values with an error naming them.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

from engine.setting_values import setting_value

T = TypeVar("T")

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
    names (dashes may stand for underscores); values are text or typed values, converted by
    the field's type as every setting's are (`engine.setting_values.setting_value`).
    ValueError naming `owner`, the key and what it accepts; the dataclass's own checks run
    last."""
    fields = {field.name: field for field in dataclasses.fields(config_type)}  # type: ignore[arg-type]
    hints = typing.get_type_hints(config_type)
    values: dict[str, Any] = {}
    for raw_key, raw_value in options.items():
        key = str(raw_key).strip().replace("-", "_")
        if key not in fields:
            known = ", ".join(sorted(fields)) or "none"
            raise ValueError(f"unknown option {raw_key!r} for {owner}; its options: {known}")
        try:
            values[key] = setting_value(hints[key], raw_value)
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
