"""The lab's flags, made as the engine makes its own (`engine.engine_args.flags`): a bench's
settings are a frozen dataclass whose fields carry `setting` metadata (group "bench"), and
the server's flags are parsed by `continuum serve`'s own parser (`parse_serve_args`)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any, NoReturn, TypeVar

from engine.config import setting
from engine.engine_args.flags import add_flags, config_of, settings_of
from engine.entrypoints import server_args

T = TypeVar("T")


def bench_setting(default: Any, help: str, **kwargs: Any) -> Any:
    """A bench settings field: `default`, and `help` for its flag (`setting`'s keywords:
    `name` where the flag is not the field's name)."""
    return dataclasses.field(default=default, metadata=setting(help, group="bench", **kwargs))


def add_settings_flags(parser: argparse.ArgumentParser, *settings_types: type) -> None:
    """A flag for each setting of `settings_types`, in the help's "benchmark" section."""
    add_flags(parser, [spec for settings_type in settings_types
                       for spec in settings_of(settings_type)])


def settings_from_args(settings_type: type[T], args: argparse.Namespace,
                       **nested: object) -> T:
    """`settings_type` of the parsed flags (`add_settings_flags`); ValueError from its
    checks."""
    return config_of(settings_type, vars(args), **nested)


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ValueError(f"--serve-args: {message}")


def parse_serve_args(serve_args: Sequence[str]) -> argparse.Namespace:
    """`continuum serve`'s flags `serve_args`, parsed by its own parser (defaults for the
    others); ValueError naming a bad one."""
    parser = _RaisingParser(prog="continuum serve", add_help=False)
    server_args.add_arguments(parser)
    return parser.parse_args(list(serve_args))
