"""`--config FILE`: settings from a TOML file, beneath the flags of the command line.

The file's keys are the settings' flat names (`max_num_seqs = 128`), each a value of the
setting's type: a boolean, an integer, a number, a string, an array of strings for a
repeatable flag, or a table for `policy_options` (its values typed: the policy converts
them as it converts a flag's text). It is read while the command line is
parsed and sets every setting whose flag the command line does not give, before or after
`--config`; an unknown key or a value of the wrong type is a usage error naming the key.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from engine.config import policy_option_value
from engine.engine_args.flags import Setting, given_flags

if sys.version_info >= (3, 11):
    import tomllib
else:  # the same parser, before the standard library took it in
    import tomli as tomllib


def read_config_file(path: str | Path, settings: Iterable[Setting]) -> dict[str, Any]:
    """The values the TOML file at `path` gives `settings`, by name, as the parsed
    namespace holds them (lists for repeatable flags, `KEY=VALUE` items for a table).
    ValueError naming the file and the key: a file that cannot be read or parsed, an
    unknown key, a value of the wrong type or not among the choices."""
    by_name = {setting.name: setting for setting in settings}
    try:
        with open(path, "rb") as file:
            table = tomllib.load(file)
    except OSError as error:
        raise ValueError(f"cannot read {path}: {error.strerror or error}") from None
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"{path} is not valid TOML: {error}") from None
    values = {}
    for key, raw in table.items():
        if key not in by_name:
            close = difflib.get_close_matches(key.replace("-", "_"), by_name, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"{path}: unknown key {key!r}{hint}")
        try:
            values[key] = namespace_value(by_name[key], raw)
        except ValueError as error:
            raise ValueError(f"{path}: {key} {error}") from None
    return values


def namespace_value(setting: Setting, raw: object) -> Any:
    """A TOML value of `setting` as its flag would have put it in the namespace (a table as
    a dict of typed values, arrays as tuples); ValueError saying what the setting takes."""
    kind = setting.kind
    if kind == "items":
        if setting.takes_mapping and isinstance(raw, Mapping):
            return {str(key): policy_option_value(key, value) for key, value in raw.items()}
        if isinstance(raw, list) and all(isinstance(item, str) for item in raw):
            return list(raw)
        table = " or a table" if setting.takes_mapping else ""
        raise ValueError(f"must be an array of strings{table}, got {raw!r}")
    if kind == "bool":
        if isinstance(raw, bool):
            return raw
        raise ValueError(f"must be true or false, got {raw!r}")
    if kind in ("int", "float"):
        numeric = isinstance(raw, int) or (kind == "float" and isinstance(raw, float))
        if not numeric or isinstance(raw, bool):
            expected = "an integer" if kind == "int" else "a number"
            raise ValueError(f"must be {expected}, got {raw!r}")
        return float(raw) if kind == "float" else raw  # type: ignore[arg-type]
    if not isinstance(raw, str):
        raise ValueError(f"must be a string, got {raw!r}")
    if setting.allowed is not None and raw not in setting.allowed:
        raise ValueError(f"must be one of {', '.join(setting.allowed)}; got {raw!r}")
    return raw


class ConfigFileAction(argparse.Action):
    """`--config FILE`: sets the file's settings in the namespace, but for those whose
    flags were given before it (those given after it overwrite it anyway). Its errors are
    the parser's usage errors."""

    def __init__(self, option_strings: list[str], dest: str, *,
                 settings: Iterable[Setting], **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.settings = tuple(settings)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        try:
            file_values = read_config_file(values, self.settings)
        except ValueError as error:
            raise argparse.ArgumentError(self, str(error)) from None
        given = given_flags(namespace)
        for name, value in file_values.items():
            if name not in given:
                setattr(namespace, name, value)
        setattr(namespace, self.dest, values)


def add_config_flag(parser: argparse.ArgumentParser, settings: Iterable[Setting]) -> None:
    """Adds `--config FILE` to `parser`, for `settings` (every one of them a key)."""
    parser.add_argument("--config", action=ConfigFileAction, settings=settings, default=None,
                        metavar="FILE",
                        help="a TOML file of settings by name (max_num_seqs = 64); flags "
                             "given override it")
