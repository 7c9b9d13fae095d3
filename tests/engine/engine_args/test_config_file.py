import argparse
import logging
from pathlib import Path

import pytest

from continuum.policy_options import InferCeptOptions
from engine.cli import main as cli_main
from engine.engine_args import EngineArgs
from engine.engine_args.config_file import read_config_file
from engine.entrypoints.server_args import (
    add_arguments,
    serve_settings,
    server_settings_from_args,
)
from engine.scheduler.options import parse_policy_options
from tests.engine.engine_args.values import as_the_file_gives, other_value, toml_line


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="continuum serve")
    add_arguments(parser)
    return parser.parse_args(argv)


def _write(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "serve.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_file_sets_every_setting_flags_and_file_only_alike(tmp_path: Path) -> None:
    values = {item.name: other_value(item) for item in serve_settings()}
    path = _write(tmp_path, *(toml_line(item, values[item.name]) for item in serve_settings()))
    args = vars(_parse(["--config", str(path)]))
    assert {name: args[name] for name in values} == {
        item.name: as_the_file_gives(item, values[item.name]) for item in serve_settings()}
    assert args["config"] == str(path)


def test_the_file_reaches_the_engine_and_the_server_settings(tmp_path: Path) -> None:
    path = _write(tmp_path, 'scheduling_policy = "fcfs"', "max_num_seqs = 8",
                  "num_kv_blocks = 64", "max_model_len = 512", 'executor = "simulated"',
                  'sim_profile = "a100-llama3.1-8b"', 'large_body_cpu = "niceness"',
                  "max_paced_refusals_per_tenant = 0", "max_n = 2",
                  'served_model_name = "agents"')
    args = _parse(["--config", str(path)])
    config = EngineArgs.from_cli_args(args).to_engine_config({})
    assert (config.scheduler.policy, config.scheduler.max_num_seqs) == ("fcfs", 8)
    assert (config.executor, config.sim_profile) == ("simulated", "a100-llama3.1-8b")
    settings = server_settings_from_args(args)
    assert (settings.large_body_cpu, settings.max_paced_refusals_per_tenant) == ("niceness", 0)
    assert (settings.max_n, settings.served_model_name) == (2, "agents")


def test_a_policy_options_table_reaches_the_policy_typed(tmp_path: Path) -> None:
    path = _write(tmp_path, 'scheduling_policy = "infercept"', "[policy_options]",
                  "swap = true", "default_tool_duration_s = 3")
    config = EngineArgs.from_cli_args(_parse(["--config", str(path)])).to_engine_config({})
    assert config.scheduler.policy_options == {"swap": True, "default_tool_duration_s": 3}
    options = parse_policy_options(InferCeptOptions, config.scheduler.policy_options,
                                   owner="infercept")
    assert options == InferCeptOptions(swap=True, default_tool_duration_s=3.0)
    bad = _write(tmp_path, 'scheduling_policy = "infercept"', "[policy_options]", "swap = 3")
    with pytest.raises(ValueError, match="option swap of scheduling policy 'infercept'"):
        EngineArgs.from_cli_args(_parse(["--config", str(bad)])).to_engine_config({})


@pytest.mark.parametrize("flags_first", [True, False])
def test_flags_override_the_file_wherever_they_stand(tmp_path: Path, flags_first: bool) -> None:
    path = _write(tmp_path, "max_num_seqs = 8", "port = 9000", "enable_prefix_caching = false",
                  'api_key = ["from-file"]', "[policy_options]", "max_plain_wait_s = 5",
                  "service_weight = 7.5")
    flags = ["--max-num-seqs", "16", "--enable-prefix-caching", "--policy-option",
             "max_plain_wait_s=1"]
    config = ["--config", str(path)]
    args = _parse(flags + config if flags_first else config + flags)
    assert (args.max_num_seqs, args.enable_prefix_caching) == (16, True)
    assert args.policy_options == ["max_plain_wait_s=1"]  # the flags replace the file's table
    assert (args.port, args.api_key) == (9000, ["from-file"])
    assert _parse(config).policy_options == {"max_plain_wait_s": 5, "service_weight": 7.5}


def test_a_number_setting_takes_an_integer_and_a_table_keeps_its_values_typed(
        tmp_path: Path) -> None:
    path = _write(tmp_path, "gpu_memory_utilization = 1", "[policy_options]",
                  "max_plain_wait_s = 30", "swap = true",
                  "estimator_warm_start = ['a.jsonl', 'b.jsonl']")
    args = _parse(["--config", str(path)])
    assert args.gpu_memory_utilization == 1.0 and isinstance(args.gpu_memory_utilization, float)
    assert args.policy_options == {"max_plain_wait_s": 30, "swap": True,
                                   "estimator_warm_start": ("a.jsonl", "b.jsonl")}


@pytest.mark.parametrize(("line", "message"), [
    ("max_num_seq = 3", "unknown key 'max_num_seq' (did you mean 'max_num_seqs'?)"),
    ("max-num-seqs = 3", "unknown key 'max-num-seqs' (did you mean 'max_num_seqs'?)"),
    ("config = 'other.toml'", "unknown key 'config'"),
    ("max_num_seqs = '8'", "max_num_seqs must be an integer, got '8'"),
    ("max_num_seqs = true", "max_num_seqs must be an integer, got True"),
    ("enable_prefix_caching = 1", "enable_prefix_caching must be true or false, got 1"),
    ("gpu_memory_utilization = 'most'", "gpu_memory_utilization must be a number"),
    ("dtype = 'int3'", "dtype must be one of auto, float32, float16, bfloat16; got 'int3'"),
    ("tool_call_parser = 'xml'", "tool_call_parser must be one of auto, hermes, llama3_json"),
    ("api_key = 'secret'", "api_key must be an array of strings, got 'secret'"),
    ("policy_options = 3", "policy_options must be an array of strings or a table"),
    ("policy_options = { swap = { on = true } }",
     "policy option 'swap' must be a string, boolean, number or array of strings"),
    ("model = 3", "model must be a string, got 3"),
    ("max_num_seqs = ", "is not valid TOML"),
])
def test_a_bad_file_is_a_usage_error_naming_the_key(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, message: str) -> None:
    path = _write(tmp_path, "port = 8123", line)
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["serve", "--config", str(path)])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "argument --config:" in error and str(path) in error and message in error, error


def test_a_missing_file_is_a_usage_error(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse(["--config", str(tmp_path / "absent.toml")])
    assert f"cannot read {tmp_path / 'absent.toml'}" in capsys.readouterr().err


def test_the_configs_check_a_file_value_as_they_check_a_flag(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = _write(tmp_path, "max_num_seqs = 0")
    with caplog.at_level(logging.ERROR):
        assert cli_main(["serve", "--config", str(path), "--port", "0"]) == 2
    assert "max_num_seqs must be a positive integer" in caplog.text


def test_read_config_file_gives_the_values_it_sets(tmp_path: Path) -> None:
    path = _write(tmp_path, "replicas = 2", 'router = "round-robin"', 'tenant = ["a:k1"]')
    assert read_config_file(path, serve_settings()) == {
        "replicas": 2, "router": "round-robin", "tenant": ["a:k1"]}
    assert read_config_file(_write(tmp_path, ""), serve_settings()) == {}
