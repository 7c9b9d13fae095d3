from __future__ import annotations

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.core.wire import EngineCoreRequest
from engine.sampling_params import SamplingParams

SMALL_CONFIG = EngineConfig(
    model=ModelConfig(max_model_len=256),
    cache=CacheConfig(num_kv_blocks=128),
    scheduler=SchedulerConfig(max_model_len=256, max_num_seqs=32),
)


def core_request(request_id: str, prompt: list[int] | None = None, *, max_tokens: int = 8,
                 **params: object) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=request_id, prompt_token_ids=prompt or [1, 2, 3, 4, 5],
        sampling_params=SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens,
                                       **params),
    )
