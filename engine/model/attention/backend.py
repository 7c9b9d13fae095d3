"""The attention backend seam: what every backend builds once a step and what every layer calls.

Layout of one layer's cache: `[2, num_slots, num_kv_heads, head_dim]` (K then V); token `p`
of a sequence lives in slot `block_table[p // block_size] * block_size + p % block_size`.
The runner allocates one block more than the scheduler's pool: `null_block_id` (the last), a
block no request owns, where the padding rows of a CUDA-graph batch write their K/V.

A step's batch is flattened into one token dimension with its single-token queries (decodes)
first. Per step the runner calls `build_metadata` once; every layer then calls
`metadata.attend(...)`, which writes the layer's new K/V into the cache and attends (a request
admitted this step may hit prefix blocks another request fills in this very step, so every
write comes before any read).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import numpy as np
import torch

from engine.model.arch import ModelArch


@dataclass(frozen=True)
class AttentionLayout:
    """The shapes a backend serves, fixed for an engine's lifetime."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    sliding_window: int | None
    device: torch.device
    dtype: torch.dtype  # activations (queries, outputs)
    max_model_len: int
    kv_dtype: torch.dtype | None = None  # what the cache stores; None: `dtype`

    @classmethod
    def of_model(cls, arch: ModelArch, block_size: int, device: torch.device,
                 dtype: torch.dtype, max_model_len: int,
                 kv_dtype: torch.dtype | None = None) -> AttentionLayout:
        return cls(num_heads=arch.num_attention_heads, num_kv_heads=arch.num_key_value_heads,
                   head_dim=arch.head_dim, block_size=block_size,
                   sliding_window=arch.sliding_window, device=device, dtype=dtype,
                   max_model_len=max_model_len, kv_dtype=kv_dtype)

    @property
    def cache_dtype(self) -> torch.dtype:
        """The dtype of the KV cache the backend reads and writes."""
        return self.dtype if self.kv_dtype is None else self.kv_dtype

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)


class ProfiledStep(NamedTuple):
    """A step of one sequence: `query_len` new tokens after `context_len` cached ones."""

    query_len: int
    context_len: int


class AttentionMetadata(ABC):
    """One step's attention plan, built once by a backend and read by every layer."""

    positions: np.ndarray  # [num_tokens] int64 (host): each token's position in its sequence
    slot_mapping: torch.Tensor  # [num_tokens] int64: the cache slot of each token's K/V

    @abstractmethod
    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               kv_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """Writes this step's `key`/`value` into `kv_cache`, then attends.

        `query` [tokens, heads, head_dim], `key`/`value` [tokens, kv_heads, head_dim];
        returns [tokens, heads, head_dim] in the query's dtype.
        """


@dataclass(frozen=True)
class DecodeBuffers:
    """Static device tensors of a decode-only batch of `batch_size` rows (a CUDA-graph bucket):
    the runner refills them before every replay, so a metadata built over them once stays valid.
    Padding rows have `seq_lens` 0 and write to the null block."""

    slot_mapping: torch.Tensor  # [batch_size] int64
    block_table: torch.Tensor  # [batch_size, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [batch_size] int32, tokens in the cache including the new one

    @property
    def batch_size(self) -> int:
        return self.slot_mapping.shape[0]


class AttentionBackend(ABC):
    """Builds per-step attention metadata for one `AttentionLayout`.

    Owned by the model runner; `build_metadata` is called once per step (and by profiling and
    benchmarks), `build_decode_metadata` once per captured CUDA-graph bucket.
    """

    name: ClassVar[str]
    # Whether `build_decode_metadata` exists: decode then runs on static buffers (CUDA graphs).
    supports_static_decode: ClassVar[bool] = False

    def __init__(self, layout: AttentionLayout) -> None:
        self.layout = layout

    @abstractmethod
    def build_metadata(self, query_lens: np.ndarray, context_lens: np.ndarray,
                       block_table: np.ndarray) -> AttentionMetadata:
        """The plan of one step of sequences given decodes first: `query_lens[i]` new tokens of
        sequence `i` follow `context_lens[i]` tokens already in the cache; `block_table[i]` lists
        its block ids (padded on the right with any block id)."""

    def build_decode_metadata(self, buffers: DecodeBuffers) -> AttentionMetadata:
        """A decode plan reading only `buffers` (whose contents change between replays)."""
        raise NotImplementedError(f"the {self.name} attention backend has no static decode")

    def profiled_steps(self, num_tokens: int) -> tuple[ProfiledStep, ...]:
        """The one-sequence steps the runner profiles at start-up on CUDA, given the step
        budget `num_tokens` (each step's memory peak, before the pool is sized; also the
        forwards that compile and tune the kernels): a prompt of `num_tokens`, with no
        cached prefix. A backend that attends other steps with other kernels or kernel
        variants adds one step for each, so that every one runs before serving."""
        return (ProfiledStep(num_tokens, 0),)

    def scratch_bytes(self, num_kv_tokens: int) -> int:
        """At most how many bytes of scratch memory one layer's attention allocates in a step
        over a pool of `num_kv_tokens` (beyond a forward's activations, which the runner
        profiles), for sizing the pool; affine in `num_kv_tokens`; 0 when attention reads the
        cache in place."""
        return 0


def step_positions(query_lens: np.ndarray, context_lens: np.ndarray) -> np.ndarray:
    """Position [num_tokens] of every token of a flattened step."""
    starts = np.cumsum(query_lens) - query_lens
    rows = np.repeat(np.arange(len(query_lens)), query_lens)
    return np.arange(rows.size) - np.repeat(starts, query_lens) + context_lens[rows]


def slot_mapping(query_lens: np.ndarray, positions: np.ndarray, block_table: np.ndarray,
                 block_size: int) -> np.ndarray:
    """Cache slot [num_tokens] of every token of a flattened step."""
    rows = np.repeat(np.arange(len(query_lens)), query_lens)
    return block_table[rows, positions // block_size] * block_size + positions % block_size


def to_device(array: np.ndarray, device: torch.device, dtype: np.dtype | None = None
              ) -> torch.Tensor:
    """A host array (cast to `dtype` if given) on `device`; on CUDA an asynchronous copy from
    pinned memory, elsewhere the array itself."""
    host = torch.from_numpy(np.ascontiguousarray(array, dtype=dtype))
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Stores the step's K/V rows at their slots."""
    kv_cache[0].index_copy_(0, slots, key)
    kv_cache[1].index_copy_(0, slots, value)


@dataclass(frozen=True)
class FlatStep:
    """What every backend derives first from a step's sequences (decodes first), on the host."""

    query_lens: np.ndarray  # [seqs] int64
    context_lens: np.ndarray  # [seqs] int64
    seq_lens: np.ndarray  # [seqs] int64, context and query
    num_decodes: int
    positions: np.ndarray  # [num_tokens] int64
    slots: np.ndarray  # [num_tokens] int64

    @classmethod
    def of(cls, query_lens: np.ndarray, context_lens: np.ndarray, block_table: np.ndarray,
           block_size: int) -> FlatStep:
        query_lens = np.asarray(query_lens, dtype=np.int64)
        context_lens = np.asarray(context_lens, dtype=np.int64)
        num_decodes = int((query_lens == 1).sum())
        assert (query_lens[:num_decodes] == 1).all(), "single-token queries must come first"
        positions = step_positions(query_lens, context_lens)
        return cls(query_lens=query_lens, context_lens=context_lens,
                   seq_lens=context_lens + query_lens, num_decodes=num_decodes,
                   positions=positions,
                   slots=slot_mapping(query_lens, positions, block_table, block_size))
