import argparse

import pytest

from engine.engine_args import EngineArgs


def test_defaults_take_the_models_context_length() -> None:
    config = EngineArgs().to_engine_config()
    assert config.scheduler.max_model_len == config.model.max_model_len == 4096
    assert config.scheduler.policy == "continuum" and config.executor == "torch"


def test_cli_flags_round_trip() -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--max-model-len", "512", "--num-kv-blocks", "64",
                              "--no-enable-prefix-caching", "--scheduling-policy", "priority",
                              "--gpu-memory-utilization", "0.5"])
    engine_args = EngineArgs.from_cli_args(args)
    config = engine_args.to_engine_config()
    assert (config.scheduler.max_model_len, config.cache.num_kv_blocks) == (512, 64)
    assert config.cache.enable_prefix_caching is False
    assert config.cache.gpu_memory_utilization == 0.5
    assert config.scheduler.policy == "priority"


def test_invalid_values_name_the_field() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineArgs(max_num_seqs=0).to_engine_config()
    with pytest.raises(ValueError, match="neither 'tiny'"):
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
