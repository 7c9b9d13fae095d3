"""The one converter of setting values: a flag's text, a policy option's text or typed
value (`--policy-option KEY=VALUE`, a config file's `[policy_options]` table, `LLM(...)`),
to a value of the setting's type. Used by the flags (`engine.engine_args.flags`) and the
policies' options (`engine.scheduler.options`); a config file's values are typed already
and checked by their kind (`engine.engine_args.config_file`).
"""

from __future__ import annotations

import math
import types
import typing
from typing import Any, Literal

_NONE_WORDS = ("none", "null")
_TRUE_WORDS = ("true", "1", "yes", "on")
_FALSE_WORDS = ("false", "0", "no", "off")


def setting_value(annotation: Any, value: object) -> Any:
    """`value`, text or already typed, as a value of the type `annotation`: `bool` (true,
    1, yes, on / false, 0, no, off), `int`, `float` (not NaN), `str`, a `Literal`'s values,
    `X | None` (none or null: None) or `tuple[str, ...]` (text: comma-separated); ValueError
    saying what it expects."""
    origin = typing.get_origin(annotation)
    arguments = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        members = [a for a in arguments if a is not type(None)]
        is_none = value is None or (isinstance(value, str)
                                    and value.strip().lower() in _NONE_WORDS)
        if is_none and len(members) < len(arguments):
            return None
        if len(members) == 1:
            return setting_value(members[0], value)
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
