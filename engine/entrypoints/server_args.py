"""The flags and `--config` file of `continuum serve`, made from the settings of the
engine (`EngineArgs`), of the app (`ServerSettings`), of the process (`ProcessSettings`)
and of the replicas (`ReplicaFlags`); shared by the single server
(`engine.entrypoints.serve`) and the Ray Serve replicas (`engine.replicas`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Literal

from engine.config import setting
from engine.engine_args import EngineArgs
from engine.engine_args.config_file import add_config_flag
from engine.engine_args.flags import (
    Setting,
    SettingsHelpFormatter,
    add_flags,
    config_of,
    flat_settings,
    settings_of,
)
from engine.entrypoints.connections import ConnectionSettings
from engine.entrypoints.openai.serving import ServerSettings
from engine.entrypoints.openai.tenants import (
    DEFAULT_TENANT,
    Tenants,
    parse_tenant_flag,
    read_keys_file,
)
from engine.replicas.replica_flags import ReplicaFlags

LogLevel = Literal["critical", "error", "warning", "info", "debug"]

USAGE = "%(prog)s [-h] [--config FILE] [FLAG ...]"
FILE_ONLY_NOTE = ("Settings without a flag (for experiments) are keys of the --config file "
                  "only; docs/operations.md lists every key.")


@dataclass(frozen=True)
class _ProcessOwnSettings:
    host: str = field(default="127.0.0.1", metadata=setting(
        "address to bind", group="server"))
    port: int = field(default=8000, metadata=setting(
        "port; 0 picks a free one", group="server"))
    api_key: tuple[str, ...] = field(default=(), metadata=setting(
        "a bearer key of tenant 'default' (repeatable)", group="server",
        metavar="KEY"))
    tenant: tuple[str, ...] = field(default=(), metadata=setting(
        "a bearer key of tenant NAME (repeatable)", group="server", metavar="NAME:KEY"))
    api_keys_file: str | None = field(default=None, metadata=setting(
        "'KEY TENANT' lines, keys off the command line", group="server",
        metavar="PATH"))
    share_prefix_cache: bool = field(default=False, metadata=setting(
        "tenants share cached prefixes", group="server"))
    log_level: LogLevel = field(default="info", metadata=setting(
        "what is logged", group="observability"))


@dataclass(frozen=True)
@flat_settings(_ProcessOwnSettings, ConnectionSettings)
class ProcessSettings:
    """The `continuum serve` process's own settings, beside the app's (`ServerSettings`)
    and the engine's (`EngineArgs`): the socket it binds, the API keys (`tenants_from_args`
    makes the tenants), its log level and the connection guards (`ConnectionSettings`,
    `connection_settings_from_args`)."""


def serve_settings() -> list[Setting]:
    """Every setting of `continuum serve`, flags and file keys alike, in `--help`'s order
    within each group."""
    return [*settings_of(ProcessSettings), *EngineArgs.settings(),
            *settings_of(ServerSettings), *settings_of(ReplicaFlags)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds every flag of `continuum serve` and its `--config` file to `parser`."""
    settings = serve_settings()
    notes = EngineArgs.flag_notes()
    # The policies' options, at the help's full width after the flags.
    policy_options = notes.pop("policy_options")
    notes["policy_options"] = "each policy's options below"
    parser.formatter_class = SettingsHelpFormatter
    parser.usage = USAGE
    parser.epilog = f"Policy options: {policy_options}\n\n{FILE_ONLY_NOTE}"
    add_config_flag(parser, settings)
    add_flags(parser, settings, notes=notes)


def tenants_from_args(args: argparse.Namespace) -> Tenants | None:
    """The tenants of `--api-key`, `--tenant` and `--api-keys-file`; None when none is
    given (no authentication); ValueError naming what is malformed."""
    pairs = [(key, DEFAULT_TENANT) for key in args.api_key]
    pairs += [parse_tenant_flag(value) for value in args.tenant]
    if args.api_keys_file is not None:
        pairs += read_keys_file(args.api_keys_file)
    if not pairs:
        if args.share_prefix_cache:
            raise ValueError("--share-prefix-cache needs API keys (there are no tenants)")
        return None
    return Tenants.from_pairs(pairs, share_prefix_cache=args.share_prefix_cache)


def server_settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """The server's settings from `continuum serve`'s flags; ValueError naming a bad one."""
    values = {setting.name: getattr(args, setting.name)
              for setting in settings_of(ServerSettings)}
    values["served_model_name"] = args.served_model_name or args.model
    return ServerSettings(tenants=tenants_from_args(args), **values)


def connection_settings_from_args(args: argparse.Namespace) -> ConnectionSettings:
    """The connection guards from `continuum serve`'s flags; ValueError naming a bad one."""
    return config_of(ConnectionSettings, vars(args))
