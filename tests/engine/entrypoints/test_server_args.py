"""The flags of `continuum serve`: its help, the settings they give, and the documents that
list them."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine.engine_args import EngineArgs
from engine.engine_args.flags import settings_tables
from engine.entrypoints.connections import ConnectionSettings
from engine.entrypoints.openai.serving import ServerSettings
from engine.entrypoints.server_args import (
    ProcessSettings,
    add_arguments,
    connection_settings_from_args,
    serve_settings,
    server_settings_from_args,
)
from engine.scheduler.policy_registry import policy_options_help

REPO = Path(__file__).resolve().parents[3]
SECTIONS = ["options:", "model:", "memory and KV cache:", "scheduling:", "server and tenants:",
            "replicas (Ray Serve; needs the 'ray' extra):", "observability:"]
def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="continuum serve")
    add_arguments(parser)
    return parser.parse_args(argv)


def _serve_help() -> list[str]:
    environ = {name: value for name, value in os.environ.items() if name != "COLUMNS"}
    return subprocess.run([sys.executable, "-m", "engine.cli", "serve", "--help"], cwd=REPO,
                          env={**environ, "COLUMNS": "80"}, capture_output=True, text=True,
                          check=True).stdout.splitlines()


def test_help_is_grouped_fits_150_lines_and_ends_with_the_policy_options() -> None:
    lines = _serve_help()
    assert len(lines) <= 150, "\n".join(lines)
    assert [line for line in lines if line in SECTIONS] == SECTIONS
    text = "\n".join(lines)
    for setting in serve_settings():
        shown = re.search(rf"--(\[no-\])?{setting.option[2:]}\b", text) is not None
        assert shown == setting.flag, setting.name
    assert "--[no-]enable-prefix-caching" in text and "--config FILE" in text
    epilog = "".join(text.split("Policy options:", 1)[1].split())
    assert "".join(policy_options_help(EngineArgs.scheduling_policy).split()) in epilog


def test_server_settings_come_from_the_flags() -> None:
    args = _parse(["--max-n", "4", "--max-waiting-requests", "9", "--tool-call-parser",
                   "hermes", "--api-key", "k1", "--tenant", "team:k2", "--model", "tiny"])
    settings = server_settings_from_args(args)
    assert (settings.max_n, settings.max_waiting_requests) == (4, 9)
    assert (settings.tool_call_parser, settings.served_model_name) == ("hermes", "tiny")
    assert settings.tenants is not None and settings.tenants.names == {"default", "team"}
    defaults = server_settings_from_args(_parse([]))
    assert defaults == ServerSettings(served_model_name="tiny")
    with pytest.raises(ValueError, match="max_n must be a positive integer"):
        server_settings_from_args(_parse(["--max-n", "0"]))


def test_the_process_settings_are_the_connection_guards_defaults() -> None:
    guards = connection_settings_from_args(_parse(["--header-timeout-s", "2.5"]))
    assert guards == ConnectionSettings(header_timeout_s=2.5)
    assert connection_settings_from_args(_parse([])) == ConnectionSettings()
    process = ProcessSettings()
    assert (process.host, process.port, process.log_level) == ("127.0.0.1", 8000, "info")


def test_operations_lists_every_setting_as_the_code_states_it() -> None:
    document = (REPO / "docs" / "operations.md").read_text()
    tables = settings_tables(serve_settings())
    assert tables in document, f"docs/operations.md should hold these tables:\n{tables}"


def _upgrading_rows() -> list[tuple[str, str]]:
    text = (REPO / "docs" / "upgrading.md").read_text()
    section = text.split("## Flags", 1)[1].split("\n## ", 1)[0]
    rows = [line.split(" | ") for line in section.splitlines()
            if line.startswith("| `--")]
    return [(row[0], row[1]) for row in rows]


def test_upgrading_names_each_flag_that_left_and_its_key() -> None:
    rows = _upgrading_rows()
    assert len(rows) >= 7
    names = {setting.name: setting for setting in serve_settings()}
    for old, now in rows:
        for flag in re.findall(r"--[a-z][a-z-]*", old):
            with pytest.raises(SystemExit):
                _parse([flag])
        for key in re.findall(r"`([a-z_]+)` key", now):
            assert key in names and not names[key].flag, key
    listed = " ".join(now for _, now in rows)
    for setting in names.values():
        if not setting.flag:
            assert f"`{setting.name}` key" in listed, setting.name
