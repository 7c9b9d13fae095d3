import argparse
import dataclasses
import typing
from typing import get_args

import pytest

from engine.config import (
    AttentionBackendName,
    CacheConfig,
    Device,
    Dtype,
    EngineConfig,
    KVCacheDtype,
    LayerKernelsName,
    LoadFormat,
    ModelConfig,
    Quantization,
    SchedulerConfig,
    StructuredOutputConfig,
    TraceConfig,
)
from engine.engine_args import EngineArgs
from engine.scheduler.policy_registry import POLICIES, policy_options_help


def test_defaults_take_the_models_context_length() -> None:
    config = EngineArgs().to_engine_config()
    assert config.scheduler.max_model_len == config.model.max_model_len == 4096
    assert config.scheduler.policy == "continuum" and config.executor == "torch"


def test_cli_flags_round_trip() -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--max-model-len", "512", "--num-kv-blocks", "64",
                              "--no-enable-prefix-caching", "--scheduling-policy", "priority",
                              "--gpu-memory-utilization", "0.5", "--quantization", "fp8"])
    engine_args = EngineArgs.from_cli_args(args)
    config = engine_args.to_engine_config()
    assert (config.scheduler.max_model_len, config.cache.num_kv_blocks) == (512, 64)
    assert config.cache.enable_prefix_caching is False
    assert config.cache.gpu_memory_utilization == 0.5
    assert config.scheduler.policy == "priority"
    assert config.model.quantization == "fp8"


def test_invalid_values_name_the_field() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineArgs(max_num_seqs=0).to_engine_config()
    with pytest.raises(ValueError, match="is not 'tiny', a catalogued model"):
        EngineArgs(model="/no/such/model").to_engine_config()


def test_tracing_is_enabled_by_the_flag_or_else_the_environment() -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--trace-path", "flag.jsonl", "--trace-max-bytes", "4096"])
    environ = {"CONTINUUM_TRACE_PATH": "env.jsonl", "VLLM_SCHED_TRACE_PATH": "vllm.jsonl"}
    trace = EngineArgs.from_cli_args(args).to_engine_config(environ).trace
    assert (trace.path, trace.max_bytes) == ("flag.jsonl", 4096)
    assert EngineArgs().to_engine_config(environ).trace.path == "env.jsonl"
    assert EngineArgs().to_engine_config(
        {"CONTINUUM_TRACE_PATH": "", "VLLM_SCHED_TRACE_PATH": "vllm.jsonl"}
    ).trace.path == "vllm.jsonl"
    assert EngineArgs().to_engine_config({}).trace.path is None
    with pytest.raises(ValueError, match="trace_max_bytes"):
        EngineArgs(trace_max_bytes=10).to_engine_config({})


def test_policy_options_reach_the_scheduler_config_from_flags_or_a_mapping() -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--policy-option", "max_plain_wait_s=5",
                              "--policy-option", "estimator=fixed-2s"])
    config = EngineArgs.from_cli_args(args).to_engine_config()
    assert config.scheduler.policy_options == {"max_plain_wait_s": "5", "estimator": "fixed-2s"}
    mapped = EngineArgs(policy_options={"max_plain_wait_s": 5,
                                        "max_ttl_s": 30.0}).to_engine_config()
    assert mapped.scheduler.policy_options == {"max_plain_wait_s": 5, "max_ttl_s": 30.0}
    flags = EngineArgs.cli_flags(args)
    assert EngineArgs.from_cli_args(parser.parse_args(flags)) == EngineArgs.from_cli_args(args)
    assert " ".join(flags).count("--policy-option") == 2
    # A typed mapping (a config file's table) goes on a command line as KEY=VALUE text.
    mapped_flags = EngineArgs.cli_flags(argparse.Namespace(**{
        **vars(args), "policy_options": {"max_plain_wait_s": 5, "swap": True}}))
    assert parser.parse_args(mapped_flags).policy_options == ["max_plain_wait_s=5",
                                                              "swap=true"]


@pytest.mark.parametrize(("policy", "options", "message"), [
    ("continuum", ("bogus=1",), "unknown option 'bogus' for scheduling policy 'continuum'"),
    ("continuum", ("max_plain_wait_s=soon",), "option max_plain_wait_s .*expected a number"),
    ("continuum", ("max_plain_wait_s",), "KEY=VALUE"),
    ("continuum", ("max_plain_wait_s=1", "max_plain_wait_s=2"), "given twice"),
    ("fcfs", ("max_plain_wait_s=1",), "'fcfs' takes no options"),
])
def test_bad_policy_options_are_refused_with_their_name(policy, options, message) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(scheduling_policy=policy, policy_options=options).to_engine_config()


def test_help_states_the_policies_and_the_default_policys_options(capsys) -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    text = "".join(capsys.readouterr().out.split())  # as wrapped, without the breaks
    assert "".join(policy_options_help(EngineArgs.scheduling_policy).split()) in text
    assert all(name in text for name in POLICIES)


# EngineArgs names that differ from their config field's name.
_RENAMED = {(SchedulerConfig, "policy"): "scheduling_policy",
            (TraceConfig, "path"): "trace_path", (TraceConfig, "max_bytes"): "trace_max_bytes"}
# Config fields whose EngineArgs default differs on purpose (see the comments in EngineArgs).
_DIFFERS = {(SchedulerConfig, "max_model_len"), (SchedulerConfig, "policy_options")}


def test_engine_args_defaults_are_the_configs() -> None:
    args_fields = {spec.name: spec for spec in dataclasses.fields(EngineArgs)}
    covered = set()
    for config in (ModelConfig, CacheConfig, SchedulerConfig, TraceConfig,
                   StructuredOutputConfig, EngineConfig):
        for spec in dataclasses.fields(config):
            if isinstance(spec.default_factory, type) and dataclasses.is_dataclass(
                    spec.default_factory):
                continue  # EngineConfig's nested configs, checked field by field
            name = _RENAMED.get((config, spec.name), spec.name)
            assert name in args_fields, f"{config.__name__}.{spec.name} has no EngineArgs field"
            covered.add(name)
            if (config, spec.name) in _DIFFERS:
                continue
            assert args_fields[name].default == spec.default, (config.__name__, spec.name)
    assert covered == set(args_fields)
    # The differing ones still mean the same by default: the model's length, no options.
    assert EngineArgs().to_engine_config().scheduler == SchedulerConfig(max_model_len=4096)


def test_cli_defaults_are_the_engine_args_defaults() -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    parsed = vars(parser.parse_args([]))
    defaults = EngineArgs()
    assert set(parsed) == {spec.name for spec in dataclasses.fields(EngineArgs)}
    for name, value in parsed.items():
        expected = getattr(defaults, name)
        assert (tuple(value) if name == "policy_options" else value) == expected, name
    assert EngineArgs.from_cli_args(parser.parse_args([])) == defaults


def test_cli_choices_are_the_config_literals() -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    choices = {action.dest: action.choices for action in parser._actions if action.choices}
    assert choices == {"dtype": get_args(Dtype), "load_format": get_args(LoadFormat),
                       "device": get_args(Device),
                       "attention_backend": get_args(AttentionBackendName),
                       "kv_cache_dtype": get_args(KVCacheDtype),
                       "layer_kernels": get_args(LayerKernelsName),
                       "quantization": get_args(Quantization)}
    hints = typing.get_type_hints(ModelConfig)
    assert (hints["dtype"], hints["load_format"], hints["device"]) == (Dtype, LoadFormat, Device)
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "int3"])
    with pytest.raises(ValueError, match="dtype must be one of auto, float32, float16, bfloat16"):
        EngineArgs(dtype="int3").to_engine_config()  # type: ignore[arg-type]


def test_kv_offload_flag_sets_the_host_tier_and_rejects_bad_sizes() -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--kv-offload-gib", "1.5"])
    assert EngineArgs.from_cli_args(args).to_engine_config().cache.kv_offload_gib == 1.5
    assert EngineArgs().to_engine_config().cache.kv_offload_gib == 0
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="kv_offload_gib"):
            EngineArgs(kv_offload_gib=bad).to_engine_config()
    with pytest.raises(ValueError, match="prefix caching"):
        EngineArgs(kv_offload_gib=1.0, enable_prefix_caching=False).to_engine_config()
