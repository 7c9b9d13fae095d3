import argparse
import dataclasses
from dataclasses import dataclass, field

import pytest

from engine.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    StructuredOutputConfig,
    TraceConfig,
    setting,
)
from engine.engine_args import EngineArgs
from engine.engine_args.flags import (
    add_flags,
    flags_of,
    flat_settings,
    given_flags,
    settings_of,
    settings_tables,
)
from engine.entrypoints.server_args import add_arguments, serve_settings
from tests.engine.engine_args.values import other_value

CONFIGS = (ModelConfig, CacheConfig, SchedulerConfig, TraceConfig, StructuredOutputConfig,
           EngineConfig)


def _serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="continuum serve")
    add_arguments(parser)
    return parser


def test_engine_args_has_one_field_per_config_setting_with_its_default() -> None:
    expected = {}
    for config in CONFIGS:
        for spec in dataclasses.fields(config):
            if "help" in spec.metadata:
                name = spec.metadata["name"] or spec.name
                default = (spec.default if spec.default is not dataclasses.MISSING
                           else spec.default_factory())  # type: ignore[misc]
                expected[name] = default
    args_fields = {spec.name: spec for spec in dataclasses.fields(EngineArgs)}
    assert list(args_fields) == list(expected)
    for name, default in expected.items():
        own = args_fields[name].default
        # policy_options: KEY=VALUE items or a mapping, empty like the config's dict.
        assert own == default or (name == "policy_options" and own == () and default == {})
        assert args_fields[name].metadata["help"]
    assert {"scheduling_policy", "trace_path", "trace_max_bytes"} <= set(args_fields)
    assert EngineArgs().to_engine_config({}).scheduler == SchedulerConfig(max_model_len=4096)


def test_flat_settings_refuses_two_settings_of_one_name_and_stray_fields() -> None:
    @dataclass(frozen=True)
    class First:
        size: int = field(default=1, metadata=setting("a size", group="model"))

    @dataclass(frozen=True)
    class Second:
        capacity: int = field(default=2, metadata=setting("a size", group="cache", name="size"))

    with pytest.raises(TypeError, match="two settings are named 'size'"):
        flat_settings(First, Second)(type("Flat", (), {}))
    stray = type("Flat", (), {"__annotations__": {"other": "int"}, "other": 3})
    with pytest.raises(TypeError, match="no setting: other"):
        flat_settings(First)(stray)
    flat = dataclass(frozen=True)(flat_settings(First)(type("Flat", (), {})))
    assert flat().size == 1 and flat(size=5).size == 5


def test_boolean_flags_have_a_negative_form_and_record_what_was_given() -> None:
    parser = _serve_parser()
    args = parser.parse_args(["--no-enable-prefix-caching", "--enforce-eager"])
    assert (args.enable_prefix_caching, args.enforce_eager) == (False, True)
    assert given_flags(args) == {"enable_prefix_caching", "enforce_eager"}
    args = parser.parse_args([])
    assert args.enable_prefix_caching is True and args.async_scheduling is None
    assert given_flags(args) == set()
    assert "--[no-]enable-prefix-caching" in parser.format_help()


def test_repeatable_flags_collect_their_items() -> None:
    args = _serve_parser().parse_args(["--policy-option", "max_plain_wait_s=5", "--api-key", "a",
                                       "--policy-option", "service_weight=9", "--api-key", "b"])
    assert args.policy_options == ["max_plain_wait_s=5", "service_weight=9"]
    assert args.api_key == ["a", "b"]
    assert _serve_parser().parse_args([]).policy_options == []


def test_settings_without_a_flag_are_in_the_namespace_only() -> None:
    parser = _serve_parser()
    args = parser.parse_args([])
    file_only = [item for item in serve_settings() if not item.flag]
    assert {item.name for item in file_only} == {
        "leave_core_to_frontend", "executor", "sim_profile", "max_paced_refusals_per_tenant",
        "large_body_cpu"}
    for item in file_only:
        assert getattr(args, item.name) == item.default
        assert item.option not in parser.format_help()
        with pytest.raises(SystemExit):
            parser.parse_args([item.option, str(other_value(item))])


def test_flags_of_gives_back_every_flag_value() -> None:
    settings = [item for item in serve_settings() if item.flag]
    values = {item.name: other_value(item) for item in settings}
    args = vars(_serve_parser().parse_args(flags_of(values, settings)))
    assert {name: args[name] for name in values} == values


def test_flags_of_refuses_a_file_only_value_and_leaves_out_none() -> None:
    settings = EngineArgs.settings()
    args = _serve_parser().parse_args(["--no-job-inference"])
    flags = flags_of(vars(args), settings)
    assert "--no-job-inference" in flags and "--max-model-len" not in flags
    assert "--executor" not in flags
    args.executor = "simulated"
    with pytest.raises(ValueError, match="executor has no flag"):
        flags_of(vars(args), settings)


def test_a_flag_takes_its_literal_choices_and_its_type() -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser, settings_of(CacheConfig))
    assert parser.parse_args(["--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"
    assert parser.parse_args(["--kv-offload-gib", "2"]).kv_offload_gib == 2.0
    for bad in (["--kv-cache-dtype", "int8"], ["--block-size", "1.5"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


@pytest.mark.parametrize(("argv", "message"), [
    (["--max-num-seqs", "abc"], "--max-num-seqs: expected an integer, got 'abc'"),
    (["--gpu-memory-utilization", "nan"], "--gpu-memory-utilization: expected a number"),
])
def test_a_flag_is_converted_as_a_policy_option_is(argv: list[str], message: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    # One converter (engine.setting_values): a flag's text and a policy option's alike.
    with pytest.raises(SystemExit):
        _serve_parser().parse_args(argv)
    assert message in capsys.readouterr().err
    parsed = _serve_parser().parse_args(["--long-prefill-token-threshold", "none"])
    assert parsed.long_prefill_token_threshold is None


def test_the_tables_list_every_setting_by_group() -> None:
    tables = settings_tables(serve_settings())
    for item in serve_settings():
        (row,) = [line for line in tables.splitlines() if line.startswith(f"| `{item.name}` |")]
        assert (item.option in row) == item.flag
        assert ("file only" in row) == (not item.flag)
    headings = [line for line in tables.splitlines() if line.startswith("**")]
    assert headings[:3] == ["**Model**", "**Memory and KV cache**", "**Scheduling**"]
