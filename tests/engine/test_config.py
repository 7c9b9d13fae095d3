import dataclasses

import pytest

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig


def test_defaults_are_valid_and_frozen() -> None:
    config = EngineConfig()
    assert config.cache.block_size == 16
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cache.block_size = 32  # type: ignore[misc]


@pytest.mark.parametrize(
    ("factory", "kwargs", "message"),
    [
        (CacheConfig, {"block_size": 0}, "block_size"),
        (CacheConfig, {"num_kv_blocks": -1}, "num_kv_blocks"),
        (CacheConfig, {"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        (SchedulerConfig, {"max_num_seqs": 0}, "max_num_seqs"),
        (SchedulerConfig, {"max_num_batched_tokens": 2.5}, "max_num_batched_tokens"),
        (SchedulerConfig, {"long_prefill_token_threshold": 0}, "long_prefill_token_threshold"),
        (SchedulerConfig, {"enable_chunked_prefill": False, "max_num_batched_tokens": 16,
                           "max_model_len": 32}, "chunked prefill"),
        (SchedulerConfig, {"enable_chunked_prefill": False, "max_num_batched_tokens": 64,
                           "max_model_len": 32, "long_prefill_token_threshold": 8},
         "requires enable_chunked_prefill"),
        (SchedulerConfig, {"policy": ""}, "policy"),
        (ModelConfig, {"dtype": "int3"}, "dtype"),
        (ModelConfig, {"load_format": "magic"}, "load_format"),
        (ModelConfig, {"model": ""}, "model"),
        (ModelConfig, {"device": "tpu"}, "device"),
        (ModelConfig, {"quantization": "int4"}, "quantization"),
        (CacheConfig, {"cpu_kv_cache_space_gib": 0}, "cpu_kv_cache_space_gib"),
        (CacheConfig, {"kv_cache_dtype": "int8"}, "kv_cache_dtype"),
        (CacheConfig, {"kv_cache_dtype": "fp8", "kv_offload_gib": 1.0}, "host tier"),
    ],
)
def test_invalid_values_are_rejected(factory, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        factory(**kwargs)


def test_engine_config_cross_checks() -> None:
    with pytest.raises(ValueError, match="simulated executor prices"):
        EngineConfig(executor="simulated", cache=CacheConfig(kv_cache_dtype="fp8"))
    with pytest.raises(ValueError, match="simulated executor prices"):
        EngineConfig(executor="simulated", model=ModelConfig(quantization="fp8"))
    with pytest.raises(ValueError, match="disagrees"):
        EngineConfig(model=ModelConfig(max_model_len=128),
                     scheduler=SchedulerConfig(max_model_len=256))
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        EngineConfig(cache=CacheConfig(num_kv_blocks=4, block_size=16),
                     scheduler=SchedulerConfig(max_model_len=128))
