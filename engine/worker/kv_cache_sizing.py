"""How many KV blocks the pool gets (fixed by config, or from a memory budget), and how many
the host tier gets."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.config import CacheConfig, KVCacheDtype, check_pool_fits_one_sequence
from engine.model.arch import ModelArch

_GIB = 2**30
_KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn}


def resolve_kv_cache_dtype(name: KVCacheDtype, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the KV cache stores: the model's for `auto`, float8 e4m3 for `fp8`."""
    return _KV_CACHE_DTYPES.get(name, model_dtype)


def kv_block_bytes(arch: ModelArch, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block holds across all layers (K and V)."""
    return block_size * arch.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size())


def determine_num_kv_blocks(
    cache_config: CacheConfig, arch: ModelArch, dtype: torch.dtype, device: torch.device,
    max_model_len: int, reserved_bytes: int = 0,
    scratch_bytes: Callable[[int], int] = lambda num_kv_tokens: 0,
) -> int:
    """`num_kv_blocks` when set; on CUDA, what fits in `gpu_memory_utilization` of the device
    after what is already allocated and `reserved_bytes` (activation peaks, CUDA graphs, the
    null block) and the scratch memory attention may take over the whole pool
    (`scratch_bytes(num_kv_tokens)`, the backend's, affine); on CPU, what fits in
    `cpu_kv_cache_space_gib` (the pool's alone). Raises `ValueError` when the pool cannot hold
    one sequence."""
    if cache_config.num_kv_blocks is not None:
        num_blocks = cache_config.num_kv_blocks
    elif device.type == "cuda":
        block_size = cache_config.block_size
        num_blocks = kv_pool_blocks(
            _budget_bytes(cache_config, device, reserved_bytes) - scratch_bytes(0),
            kv_block_bytes(arch, block_size, dtype),
            scratch_bytes(block_size) - scratch_bytes(0))
    else:
        num_blocks = kv_pool_blocks(_budget_bytes(cache_config, device, reserved_bytes),
                                    kv_block_bytes(arch, cache_config.block_size, dtype), 0)
    check_pool_fits_one_sequence(int(num_blocks), cache_config.block_size, max_model_len)
    return int(num_blocks)


def kv_pool_blocks(budget_bytes: int, block_bytes: int, scratch_bytes_per_block: int) -> int:
    """Blocks such that the pool and the scratch of attending to all of it fit the budget."""
    return max(budget_bytes, 0) // (block_bytes + scratch_bytes_per_block)


def determine_num_host_kv_blocks(
    cache_config: CacheConfig, arch: ModelArch, dtype: torch.dtype
) -> int:
    """Blocks of the host tier: as many whole blocks (all layers, K and V) as fit in
    `kv_offload_gib`; 0 when it is 0 (no tier). The tier is host memory of its own, so it
    never shrinks the device pool (not even on CPU, whose pool has `cpu_kv_cache_space_gib`).
    Raises `ValueError` when a budget above 0 holds no block."""
    if not cache_config.kv_offload_gib:
        return 0
    block_bytes = kv_block_bytes(arch, cache_config.block_size, dtype)
    num_blocks = int(cache_config.kv_offload_gib * _GIB) // block_bytes
    if num_blocks == 0:
        raise ValueError(f"kv_offload_gib={cache_config.kv_offload_gib!r} holds no KV block "
                         f"({block_bytes} bytes)")
    return num_blocks


def _budget_bytes(cache_config: CacheConfig, device: torch.device, reserved_bytes: int) -> int:
    if device.type == "cuda":
        free_bytes, total_bytes = torch.cuda.mem_get_info(device)
        used_bytes = total_bytes - free_bytes
        return int(total_bytes * cache_config.gpu_memory_utilization) - used_bytes - reserved_bytes
    return int(cache_config.cpu_kv_cache_space_gib * _GIB)
