"""A value other than the default for each setting, for the tests that set them all."""

from __future__ import annotations

from typing import Any

from engine.engine_args.flags import Setting


def other_value(setting: Setting) -> Any:
    """A valid-looking value of `setting`'s type that is not its default, as the parsed
    namespace holds it (a list of items for a repeatable flag)."""
    if setting.kind == "bool":
        return setting.default is not True
    if setting.kind == "int":
        return 7 if setting.default is None else setting.default + 1
    if setting.kind == "float":
        return 0.5 if setting.default is None else setting.default + 0.25
    if setting.kind == "items":
        return ["first=1", "second=two"]
    if setting.allowed is not None:
        return next(value for value in setting.allowed if value != setting.default)
    return f"{setting.name}-value"


def toml_line(setting: Setting, value: Any) -> str:
    """`value` of `setting` as a line of a TOML file (a repeatable flag's items as a table
    when the setting takes a mapping, else as an array)."""
    if isinstance(value, bool):
        text = str(value).lower()
    elif isinstance(value, (int, float)):
        text = repr(value)
    elif isinstance(value, list):
        if setting.takes_mapping:
            pairs = (item.split("=", 1) for item in value)
            text = "{ " + ", ".join(f'{key} = "{item}"' for key, item in pairs) + " }"
        else:
            text = "[" + ", ".join(f'"{item}"' for item in value) + "]"
    else:
        text = f'"{value}"'
    return f"{setting.name} = {text}"


def as_the_file_gives(setting: Setting, value: Any) -> Any:
    """`value` as the namespace holds it once `toml_line` read it back: a mapping's items as
    a dict of the strings it wrote."""
    if setting.takes_mapping and isinstance(value, list):
        return dict(item.split("=", 1) for item in value)
    return value
