"""Command-line flags made from settings: the dataclass fields that carry
`engine.config.setting` metadata.

A setting's flat name is its flag (`--max-num-seqs`), its key in a `--config` file and the
attribute of the parsed namespace; its field's type says how its value is parsed (a
`Literal` gives the choices, a boolean gives `--name` and `--no-name`, a tuple or a mapping
a repeatable flag) and its default is the flag's. The flags record which of them the
command line gave, so that a config file read while parsing sets only the others.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import NoneType, UnionType
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

from engine.config import SettingGroup
from engine.setting_values import setting_value

T = TypeVar("T")

GROUP_TITLES: dict[SettingGroup, str] = {
    "model": "model",
    "cache": "memory and KV cache",
    "scheduling": "scheduling",
    "server": "server and tenants",
    "replicas": "replicas (Ray Serve; needs the 'ray' extra)",
    "observability": "observability",
    "bench": "benchmark",
    "policy": "policy options (--policy-option KEY=VALUE)",
}

# The namespace attribute holding the names of the settings whose flags were given.
_GIVEN = "_given_flags"

ValueKind = Literal["bool", "int", "float", "str", "items"]


@dataclass(frozen=True)
class Setting:
    """One setting, read from its dataclass field: flat `name`, the field's type `hint` and
    `default` (None for a field without one), and the `engine.config.setting` metadata."""

    name: str
    hint: Any
    default: Any
    help: str
    group: SettingGroup
    flag: bool
    own_option: str | None
    metavar: str | None
    choices: tuple[str, ...] | None
    default_text: str | None

    @property
    def option(self) -> str:
        """The flag: its own, else `--` and the name, dashes for underscores."""
        return self.own_option or "--" + self.name.replace("_", "-")

    @property
    def kind(self) -> ValueKind:
        """What a value is: `items` for a tuple or mapping (a repeatable flag; `KEY=VALUE`
        items for a mapping)."""
        members = _members(self.hint)
        if any(get_origin(member) in (tuple, dict, Mapping) or member in (tuple, dict)
               for member in members):
            return "items"
        for kind in (bool, int, float):
            if kind in members:
                return kind.__name__  # type: ignore[return-value]
        return "str"

    @property
    def takes_mapping(self) -> bool:
        """Whether the setting's value may be a mapping (given as `KEY=VALUE` items)."""
        return any(get_origin(member) in (dict, Mapping) or member is dict
                   for member in _members(self.hint))

    @property
    def allowed(self) -> tuple[str, ...] | None:
        """The values a `str` setting takes: its `Literal`'s, else its metadata's, else
        None (any)."""
        for member in _members(self.hint):
            if get_origin(member) is Literal:
                return get_args(member)
        return self.choices

    @property
    def namespace_default(self) -> Any:
        """The parsed namespace's value when neither flag nor file sets it (a list for a
        repeatable flag, which appends to it)."""
        return [] if self.kind == "items" else self.default


def _members(hint: Any) -> tuple[Any, ...]:
    members = get_args(hint) if isinstance(hint, UnionType) else (hint,)
    return tuple(member for member in members if member is not NoneType)


def settings_of(cls: type) -> list[Setting]:
    """The settings of dataclass `cls`: its fields with `setting` metadata, in order."""
    hints = get_type_hints(cls)
    found = []
    for spec in dataclasses.fields(cls):
        if "help" not in spec.metadata:
            continue
        default: Any = None
        if spec.default is not dataclasses.MISSING:
            default = spec.default
        elif spec.default_factory is not dataclasses.MISSING:
            default = spec.default_factory()
        found.append(Setting(
            name=spec.metadata["name"] or spec.name, hint=hints[spec.name], default=default,
            help=spec.metadata["help"], group=spec.metadata["group"],
            flag=spec.metadata["flag"], own_option=spec.metadata["option"],
            metavar=spec.metadata["metavar"], choices=spec.metadata["choices"],
            default_text=spec.metadata["default_text"],
        ))
    return found


def config_of(config: type[T], values: Mapping[str, object], **nested: object) -> T:
    """`config` of `nested` (its configs) and of the flat `values` (a parsed namespace's, by
    setting name): each other field's value is the one under its flat name (its setting's,
    else its own name); a field without one keeps its default."""
    kwargs = dict(nested)
    for spec in dataclasses.fields(config):  # type: ignore[arg-type]
        name = spec.metadata.get("name") or spec.name
        if spec.name not in nested and name in values:
            kwargs[spec.name] = values[name]
    return config(**kwargs)


def flat_settings(*configs: type) -> Callable[[type[T]], type[T]]:
    """A class decorator, applied before `dataclass`: gives the class one field per setting
    of `configs` (in their order), under the setting's flat name, with the config field's
    type, default and metadata. A field the class declares itself keeps its type and
    default and takes the metadata; TypeError for two settings of one name or a declared
    field that is no setting."""

    def decorate(cls: type[T]) -> type[T]:
        declared = dict(inspect.get_annotations(cls))
        annotations: dict[str, Any] = {}
        for config in configs:
            hints = get_type_hints(config)
            for spec in dataclasses.fields(config):
                if "help" not in spec.metadata:
                    continue
                name = spec.metadata["name"] or spec.name
                if name in annotations:
                    raise TypeError(f"two settings are named {name!r}")
                if name in declared:
                    annotations[name] = declared.pop(name)
                    own = dataclasses.field(default=cls.__dict__[name], metadata=spec.metadata)
                else:
                    annotations[name] = hints[spec.name]
                    own = dataclasses.field(default=spec.default,
                                            default_factory=spec.default_factory,
                                            metadata=spec.metadata)
                setattr(cls, name, own)
        if declared:
            raise TypeError(f"{cls.__name__} declares fields that are no setting: "
                            f"{', '.join(declared)}")
        cls.__annotations__ = annotations
        return cls

    return decorate


def value_text(value: object) -> str:
    """A value as a flag would give it: booleans in lowercase, sequences comma-separated."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)


def mark_given(namespace: argparse.Namespace, name: str) -> bool:
    """Records that the flag of setting `name` was given; True the first time."""
    given = vars(namespace).setdefault(_GIVEN, set())
    first = name not in given
    given.add(name)
    return first


def given_flags(namespace: argparse.Namespace) -> frozenset[str]:
    """The settings whose flags the command line gave (so far, while parsing)."""
    return frozenset(getattr(namespace, _GIVEN, ()))


class _FlagValue:
    """A flag's text as its setting's value, by the one converter of setting values
    (`engine.setting_values`); argparse reports its message as the flag's error."""

    def __init__(self, hint: Any) -> None:
        self.hint = hint

    def __call__(self, text: str) -> Any:
        try:
            return setting_value(self.hint, text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None


class _Store(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        mark_given(namespace, self.dest)
        setattr(namespace, self.dest, values)


class _Append(argparse.Action):
    """A repeatable flag: the first given replaces the value (a config file's too)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        items = [] if mark_given(namespace, self.dest) else list(getattr(namespace, self.dest))
        setattr(namespace, self.dest, [*items, values])


class _Boolean(argparse.Action):
    """`--name` sets True, `--no-name` False."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        negative = "--no-" + option_strings[0].removeprefix("--")
        super().__init__([*option_strings, negative], dest, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        mark_given(namespace, self.dest)
        setattr(namespace, self.dest, not (option_string or "").startswith("--no-"))


class SettingsHelpFormatter(argparse.HelpFormatter):
    """argparse's help, with a wider flag column, a boolean as `--[no-]name`, and the
    description's and epilog's paragraphs (blank-line separated) filled one by one."""

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 33,
                 width: int | None = None) -> None:
        super().__init__(prog, indent_increment, max_help_position, width)

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if isinstance(action, _Boolean):
            return "--[no-]" + action.option_strings[0].removeprefix("--")
        return super()._format_action_invocation(action)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n\n".join(super(SettingsHelpFormatter, self)._fill_text(paragraph, width, indent)
                           for paragraph in text.split("\n\n"))


def _default_text(setting: Setting) -> str:
    if setting.default_text is not None:
        return f" (default: {setting.default_text})"
    if setting.default is None or setting.kind == "items":
        return ""
    if setting.kind == "bool":
        return " (default: on)" if setting.default else " (default: off)"
    return f" (default: {setting.default})"


def _metavar(setting: Setting) -> str | None:
    if setting.metavar is not None or setting.allowed is not None:
        return setting.metavar  # None: argparse shows the choices
    return "N" if setting.kind in ("int", "float") else setting.name.upper()


def _group(parser: argparse.ArgumentParser, group: SettingGroup) -> Any:
    """The parser's argument group of `group`; made with all the others, in their order,
    the first time (argparse leaves an empty group out of the help)."""
    groups = {action_group.title: action_group for action_group in parser._action_groups}
    if GROUP_TITLES[group] not in groups:
        for title in GROUP_TITLES.values():
            if title not in groups:
                groups[title] = parser.add_argument_group(title)
    return groups[GROUP_TITLES[group]]


def add_flags(parser: argparse.ArgumentParser, settings: Iterable[Setting], *,
              notes: Mapping[str, str] | None = None) -> None:
    """Adds the flag of each setting to `parser`, in its group's section, its help followed
    by `notes` for it (what only a higher layer knows: a registry's names) and its default.
    A setting without a flag (`flag=False`) gets only its default in the namespace."""
    notes = notes or {}
    for setting in settings:
        if not setting.flag:
            parser.set_defaults(**{setting.name: setting.namespace_default})
            continue
        note = f"; {notes[setting.name]}" if setting.name in notes else ""
        help_text = (setting.help + note + _default_text(setting)).replace("%", "%%")
        group = _group(parser, setting.group)
        common: dict[str, Any] = {"dest": setting.name, "default": setting.namespace_default,
                                  "help": help_text}
        if setting.kind == "bool":
            group.add_argument(setting.option, action=_Boolean, **common)
        elif setting.kind == "items":
            group.add_argument(setting.option, action=_Append, metavar=_metavar(setting),
                               **common)
        else:
            group.add_argument(setting.option, action=_Store, type=_FlagValue(setting.hint),
                               choices=setting.allowed, metavar=_metavar(setting), **common)


def flags_of(values: Mapping[str, Any], settings: Iterable[Setting]) -> list[str]:
    """The command line that gives `values` (a parsed namespace's, by setting name) to
    `add_flags`' flags: None values left out. ValueError for a setting without a flag that
    differs from its default (only a config file can give it)."""
    flags: list[str] = []
    for setting in settings:
        value = values.get(setting.name)
        if not setting.flag:
            if value not in (None, setting.namespace_default):
                raise ValueError(f"{setting.name} has no flag (only a --config file sets it)")
            continue
        if value is None:
            continue
        if setting.kind == "bool":
            flags.append(setting.option if value else "--no-" + setting.option[2:])
        elif setting.kind == "items":
            items = ([f"{key}={value_text(item)}" for key, item in value.items()]
                     if isinstance(value, Mapping) else value)
            flags += [part for item in items for part in (setting.option, item)]
        else:
            flags += [setting.option, str(value)]
    return flags


def settings_tables(settings: Iterable[Setting]) -> str:
    """`settings` as Markdown, a table per group in `--help`'s order (none for a group
    without settings): each setting's file key, flag, default (a TOML value; blank for none)
    and help, for docs/operations.md."""
    settings = list(settings)
    parts = []
    for group, title in GROUP_TITLES.items():
        members = [setting for setting in settings if setting.group == group]
        if not members:
            continue
        rows = [f"**{title[0].upper()}{title[1:]}**", "", "| Key | Flag | Default | What |",
                "| --- | --- | --- | --- |"]
        for setting in members:
            flag = f"`{setting.option}`" if setting.flag else "file only"
            values = "" if setting.allowed is None else (
                " One of " + ", ".join(f"`{value}`" for value in setting.allowed) + ".")
            rows.append(f"| `{setting.name}` | {flag} | {_toml_default(setting)} | "
                        f"{setting.help.replace('|', '/')}.{values} |")
        parts.append("\n".join(rows) + "\n")
    return "\n".join(parts)


def _toml_default(setting: Setting) -> str:
    if setting.default_text is not None:
        return setting.default_text
    if setting.default is None or setting.kind == "items":
        return ""
    if setting.kind == "bool":
        return f"`{str(setting.default).lower()}`"
    if setting.kind == "str":
        return f'`"{setting.default}"`'
    return f"`{setting.default}`"
