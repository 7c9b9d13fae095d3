"""The Triton attention backends: kernels that read K/V straight from the paged cache.

`triton`: decode runs split-K (flash-decoding) over each sequence's blocks; prefill and
chunked extend run one causal kernel over the cached prefix and the step's own tokens.
Nothing is gathered into a workspace, and no step reads a device value on the host, so a
decode plan over static buffers can be captured in a CUDA graph. On CPU the same kernels run
under Triton's interpreter (`TRITON_INTERPRET=1`, for tests).

`triton-sdpa`: the same, but a prompt with no cached prefix, long enough to pay for a call of
its own, is attended by torch's SDPA (its flash kernel on CUDA) over the step's own K/V,
which are contiguous there: no cache read, no gather. Its K/V are still written to the cache.
Each such prompt is padded to a bucket of rows (`sdpa_padded_rows`), so that SDPA sees a few
shapes, each prepared at start-up, rather than one per prompt length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from engine.model.attention import triton_kernels
from engine.model.attention.backend import (
    AttentionBackend,
    AttentionLayout,
    AttentionMetadata,
    DecodeBuffers,
    FlatStep,
    ProfiledStep,
    to_device,
)
from engine.model.attention.sdpa import sdpa_in_row_slices
from engine.model.triton_support import check_triton_runs_on

# Triton compiles float8 e4m3 only for GPUs of this compute capability or newer (Ada, Hopper).
MIN_FP8_CAPABILITY = (8, 9)
# `triton-sdpa` gives SDPA the prompts of a step that have no cached prefix and at least this
# many tokens. On an H100 (`eval/gpu/prefill_tiles.py`, Llama-3.1-8B's heads) a call took
# 83-87 us a layer for a prompt of 256, 512 or 2,048 tokens, where the prefill kernel took
# 137 us for one prompt of 2,048, 84 for four of 512 and 82 for eight of 256, all in one
# launch: SDPA repays its call only for long prompts. The kernel's time for one prompt,
# about quadratic in its length, reaches a call's near 1,610 tokens (by that scaling; not
# timed there); 1,792 is the padded row count at or above it (`sdpa_padded_rows`).
MIN_SDPA_PROMPT_TOKENS = 1792
# The chunk of the start-up step that tunes the split prefill kernel: an agent's next turn.
_PROFILED_CHUNK_TOKENS = 256
# SDPA's rows are padded to a multiple of this, or of an eighth of the next power of two at
# or above the prompt's length where that is more (`sdpa_padded_rows`). On an H100 an offline
# run whose prompts had every length from 128 to 1,024 took 39.2 ms a step under
# `triton-sdpa` against 17.6 under `triton`, its admitting steps 330-400 ms each, while a
# prompt of one repeated length ran faster than the kernel: a cost per new shape, not per
# token (docs/decisions/0009-triton-sdpa.md).
_SDPA_ROWS_QUANTUM = 256

# How a prefill is attended: SDPA over the step's own K/V (`triton-sdpa`), the prefill kernel,
# or its variant that splits each program's keys.
PrefillAttention = Literal["sdpa", "kernel", "split kernel"]


def check_float8_runs_on(device: torch.device) -> None:
    """ValueError when the kernels cannot read a float8 cache on `device` (a CUDA GPU older
    than `MIN_FP8_CAPABILITY`); the CPU's interpreter can."""
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_FP8_CAPABILITY:
        raise ValueError(
            f"kv_cache_dtype fp8 needs a GPU of compute capability "
            f"{'.'.join(map(str, MIN_FP8_CAPABILITY))} or newer for Triton's float8 e4m3; "
            f"this one has {'.'.join(map(str, capability))}")


@dataclass(frozen=True)
class DecodePlan:
    """The decodes of a step: rows `[0, batch)` of its flat batch."""

    block_table: torch.Tensor  # [batch, blocks] int32
    seq_lens: torch.Tensor  # [batch] int32
    num_splits: int


@dataclass(frozen=True)
class PrefillPlan:
    """The longer queries of a step, flattened after its decodes."""

    block_table: torch.Tensor  # [seqs, blocks] int32
    query_start_loc: torch.Tensor  # [seqs + 1] int32, relative to the first prefill token
    seq_lens: torch.Tensor  # [seqs] int32
    max_query_len: int
    num_splits: int = 1  # key splits of each program (`default_prefill_splits`)


@dataclass(frozen=True)
class TritonMetadata(AttentionMetadata):
    positions: np.ndarray
    slot_mapping: torch.Tensor
    num_decode_tokens: int
    decode: DecodePlan | None
    prefill: PrefillPlan | None  # the prefill kernel's sequences, after the decodes
    layout: AttentionLayout
    # [start, end) token rows of the step's last sequences, each a prompt with no cached
    # prefix that SDPA attends over the step's own K/V (`triton-sdpa`); after `prefill`'s.
    sdpa_prompts: tuple[tuple[int, int], ...] = ()

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               kv_cache: torch.Tensor, scale: float) -> torch.Tensor:
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        triton_kernels.store_kv(key, value, k_cache, v_cache, self.slot_mapping)
        if self.sdpa_prompts == ((0, query.shape[0]),):
            # SDPA's output is the step's: no copy into an output of the step's own.
            return causal_sdpa(query, key, value, scale)
        output = torch.empty_like(query)
        split = self.num_decode_tokens
        kernel_rows_end = self.sdpa_prompts[0][0] if self.sdpa_prompts else query.shape[0]
        block_size, window = self.layout.block_size, self.layout.sliding_window
        if self.decode is not None:
            triton_kernels.paged_decode_attention(
                query[:split], k_cache, v_cache, self.decode.block_table, self.decode.seq_lens,
                scale, block_size=block_size, num_splits=self.decode.num_splits,
                sliding_window=window, out=output[:split])
        if self.prefill is not None:
            triton_kernels.paged_prefill_attention(
                query[split:kernel_rows_end], k_cache, v_cache, self.prefill.block_table,
                self.prefill.query_start_loc, self.prefill.seq_lens, scale,
                block_size=block_size, max_query_len=self.prefill.max_query_len,
                sliding_window=window, out=output[split:kernel_rows_end],
                num_splits=self.prefill.num_splits)
        for start, end in self.sdpa_prompts:
            output[start:end] = causal_sdpa(query[start:end], key[start:end],
                                            value[start:end], scale)
        return output


def causal_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                scale: float) -> torch.Tensor:
    """One prompt's causal attention over its own K/V by torch's SDPA: `query` [tokens, heads,
    head_dim], `key`/`value` [tokens, kv_heads, head_dim]; returns [tokens, heads, head_dim].
    SDPA runs on `sdpa_padded_rows(tokens)` rows of each, zeros after the prompt's: under the
    causal mask no row of the prompt reaches the padding's keys."""
    tokens = query.shape[0]
    padding = sdpa_padded_rows(tokens) - tokens
    if padding:
        query, key, value = (torch.nn.functional.pad(rows, (0, 0, 0, 0, 0, padding))
                             for rows in (query, key, value))
    out = sdpa_in_row_slices(query, key, value, mask=None, scale=scale, max_score_bytes=None)
    return out[:tokens] if padding else out


def sdpa_padded_rows(tokens: int) -> int:
    """The rows `causal_sdpa` runs SDPA on for a prompt of `tokens` (>= 1): a multiple of 256
    up to 2,048, then of an eighth of the next power of two (512 up to 4,096, 1,024 up to
    8,192, ...): 8 shapes up to 2,048 rows and 4 for each doubling beyond, with fewer than a
    quarter more rows than the prompt's there."""
    quantum = max(_SDPA_ROWS_QUANTUM, triton_kernels.next_power_of_two(tokens) // 8)
    return -(-tokens // quantum) * quantum


def _sdpa_input(tokens: int) -> tuple[int, bool]:
    """What SDPA is given for a prompt of `tokens`: its rows, and whether they are padded."""
    rows = sdpa_padded_rows(tokens)
    return rows, rows != tokens


class TritonBackend(AttentionBackend):
    """Paged attention in Triton kernels; needs CUDA, or the interpreter on CPU."""

    name = "triton"
    supports_static_decode = True

    def __init__(self, layout: AttentionLayout) -> None:
        if not triton_kernels.supports(layout.head_dim, layout.block_size):
            raise ValueError(
                f"the triton attention backend does not cover head_dim={layout.head_dim} with "
                f"block_size={layout.block_size} (head_dim 32, 64 or 128 and a power-of-two "
                "block_size >= 8); use --attention-backend sdpa")
        check_triton_runs_on(layout.device, "the triton attention backend")
        if layout.cache_dtype not in (layout.dtype, triton_kernels.FP8_KV_DTYPE):
            raise ValueError(f"the triton attention backend reads a KV cache of the model's "
                             f"dtype or {triton_kernels.FP8_KV_DTYPE}, not {layout.cache_dtype}")
        if layout.cache_dtype == triton_kernels.FP8_KV_DTYPE:
            check_float8_runs_on(layout.device)
        super().__init__(layout)

    def build_metadata(self, query_lens: np.ndarray, context_lens: np.ndarray,
                       block_table: np.ndarray) -> TritonMetadata:
        layout = self.layout
        step = FlatStep.of(query_lens, context_lens, block_table, layout.block_size)
        query_lens, seq_lens, num_decodes = step.query_lens, step.seq_lens, step.num_decodes
        num_kernel_seqs = len(query_lens) - self.num_sdpa_prompts(step)
        token_ends = np.cumsum(query_lens)
        return TritonMetadata(
            positions=step.positions,
            slot_mapping=to_device(step.slots, layout.device),
            num_decode_tokens=num_decodes,
            decode=self._decode_plan(seq_lens[:num_decodes], block_table[:num_decodes])
            if num_decodes else None,
            prefill=self._prefill_plan(query_lens[num_decodes:num_kernel_seqs],
                                       seq_lens[num_decodes:num_kernel_seqs],
                                       block_table[num_decodes:num_kernel_seqs])
            if num_decodes < num_kernel_seqs else None,
            layout=layout,
            sdpa_prompts=tuple((int(end - length), int(end)) for length, end in zip(
                query_lens[num_kernel_seqs:].tolist(), token_ends[num_kernel_seqs:].tolist(),
                strict=True)),
        )

    def num_sdpa_prompts(self, step: FlatStep) -> int:
        """How many of the step's last sequences SDPA attends instead of the prefill kernel
        (`is_sdpa_prompt`; the runner lays such prompts out last)."""
        count = 0
        for query_len, context_len in zip(step.query_lens[::-1].tolist(),
                                          step.context_lens[::-1].tolist(), strict=True):
            if not self.is_sdpa_prompt(query_len, context_len):
                break
            count += 1
        return count

    def build_decode_metadata(self, buffers: DecodeBuffers) -> TritonMetadata:
        layout = self.layout
        num_splits = triton_kernels.default_num_splits(
            layout.max_model_len, layout.block_size, buffers.batch_size, layout.num_kv_heads)
        return TritonMetadata(
            positions=np.zeros(0, dtype=np.int64),
            slot_mapping=buffers.slot_mapping,
            num_decode_tokens=buffers.batch_size,
            decode=DecodePlan(buffers.block_table, buffers.seq_lens, num_splits),
            prefill=None,
            layout=layout,
        )

    def _decode_plan(self, seq_lens: np.ndarray, block_table: np.ndarray) -> DecodePlan:
        max_seq_len = int(seq_lens.max())
        num_blocks = -(-max_seq_len // self.layout.block_size)
        return DecodePlan(
            block_table=self._device_int32(block_table[:, :num_blocks]),
            seq_lens=self._device_int32(seq_lens),
            num_splits=triton_kernels.default_num_splits(
                max_seq_len, self.layout.block_size, len(seq_lens), self.layout.num_kv_heads),
        )

    def _prefill_plan(self, query_lens: np.ndarray, seq_lens: np.ndarray,
                      block_table: np.ndarray) -> PrefillPlan:
        max_seq_len = int(seq_lens.max())
        num_blocks = -(-max_seq_len // self.layout.block_size)
        return PrefillPlan(
            block_table=self._device_int32(block_table[:, :num_blocks]),
            query_start_loc=self._device_int32(np.concatenate([[0], np.cumsum(query_lens)])),
            seq_lens=self._device_int32(seq_lens),
            max_query_len=int(query_lens.max()),
            num_splits=self._prefill_splits(query_lens.tolist(), max_seq_len),
        )

    def _prefill_splits(self, query_lens: list[int], max_seq_len: int) -> int:
        layout = self.layout
        return triton_kernels.default_prefill_splits(
            query_lens, max_seq_len, layout.num_heads, layout.num_kv_heads, layout.head_dim,
            layout.sliding_window)

    def profiled_steps(self, num_tokens: int) -> tuple[ProfiledStep, ...]:
        """The full-budget prompt, then one step for each other way this backend can attend a
        prefill (`attention_of`) that a serving step can reach, so that each compiles (and
        the prefill kernel's tile is tuned, apart with and without key splits) before
        serving. In order of preference: a chunk at the budget over one cached token, a
        chunk over one cached token whose sequence holds under 1,024 tokens (too short to
        split), and a chunk of 256 tokens, or of one query tile of the split rule, over the
        longest context. The last splits wherever any step does: no step launches fewer
        programs, and none reaches more keys a program."""
        layout = self.layout
        max_model_len = layout.max_model_len
        steps = list(super().profiled_steps(num_tokens))
        short = min(num_tokens, 2 * triton_kernels.MIN_PREFILL_KEYS_PER_SPLIT - 1)
        tile = triton_kernels.split_rule_query_tile(layout.num_heads, layout.num_kv_heads)
        candidates = [ProfiledStep(num_tokens - 1, 1), ProfiledStep(max(short - 1, 2), 1)]
        candidates += [ProfiledStep(query_len, max_model_len - query_len)
                       for query_len in (min(_PROFILED_CHUNK_TOKENS, num_tokens),
                                         max(min(tile, num_tokens), 2))]
        reached = {self.attention_of(step) for step in steps}
        for step in candidates:
            if not (2 <= step.query_len <= num_tokens and step.context_len >= 0
                    and step.query_len + step.context_len <= max_model_len):
                continue
            attention = self.attention_of(step)
            if attention not in reached:
                steps.append(step)
                reached.add(attention)
        return tuple(steps)

    def attention_of(self, step: ProfiledStep) -> PrefillAttention:
        """How a step of one sequence (`query_len` >= 2) is attended."""
        if self.is_sdpa_prompt(step.query_len, step.context_len):
            return "sdpa"
        splits = self._prefill_splits([step.query_len], step.query_len + step.context_len)
        return "split kernel" if splits > 1 else "kernel"

    def is_sdpa_prompt(self, query_len: int, context_len: int) -> bool:
        """Whether SDPA attends a sequence of `query_len` new tokens after `context_len`
        cached ones, when it comes last in a step: never in `triton`."""
        return False

    def scratch_bytes(self, num_kv_tokens: int) -> int:
        """The partials of a prefill whose keys are split: at most
        `triton_kernels.PREFILL_PARTIALS_BYTES` whatever the pool."""
        return triton_kernels.PREFILL_PARTIALS_BYTES

    def _device_int32(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.layout.device, np.int32)


class TritonSdpaBackend(TritonBackend):
    """`triton` with torch's SDPA for the prompts of at least `min_sdpa_prompt_tokens` tokens
    that have no cached prefix: on CUDA SDPA's flash kernel, which the `sdpa` backend ran
    faster than the prefill kernel on an H100 (docs/decisions/0009-triton-sdpa.md).

    SDPA takes no prompt (`sdpa_applies` False) where it would be slow or would read other
    K/V than the kernels: in a sliding window (which SDPA applies through a mask, so with its
    math kernel); on CUDA in float32 or before compute capability 8.0 (no flash kernel: the
    math kernel would hold every head's scores of the prompt); with a KV cache of another
    dtype than the model's (fp8: the kernels read the cache's rounded K/V, SDPA would read
    the step's own, so a prompt's result would depend on whether it hit the prefix cache).
    """

    name = "triton-sdpa"

    def __init__(self, layout: AttentionLayout,
                 min_sdpa_prompt_tokens: int | None = None) -> None:
        """`min_sdpa_prompt_tokens`: the shortest prompt SDPA takes; None:
        `MIN_SDPA_PROMPT_TOKENS`, read when the backend is built."""
        super().__init__(layout)
        if min_sdpa_prompt_tokens is None:
            min_sdpa_prompt_tokens = MIN_SDPA_PROMPT_TOKENS
        if min_sdpa_prompt_tokens < 1:
            raise ValueError(f"min_sdpa_prompt_tokens must be >= 1, got "
                             f"{min_sdpa_prompt_tokens}")
        self.min_sdpa_prompt_tokens = min_sdpa_prompt_tokens
        self.sdpa_applies = (layout.sliding_window is None
                             and layout.cache_dtype == layout.dtype
                             and _has_flash_sdpa(layout))

    def is_sdpa_prompt(self, query_len: int, context_len: int) -> bool:
        """A prompt with no cached prefix and at least `min_sdpa_prompt_tokens` tokens, where
        SDPA applies."""
        return (self.sdpa_applies and context_len == 0
                and query_len >= self.min_sdpa_prompt_tokens)

    def profiled_steps(self, num_tokens: int) -> tuple[ProfiledStep, ...]:
        """`triton`'s steps, then a prompt for each other input SDPA can be given, so that
        it meets each before serving: for each count of rows (`sdpa_padded_rows`) of the
        prompts from `min_sdpa_prompt_tokens` to `num_tokens`, a prompt shorter than the
        count (padded: a contiguous copy) and one of the count itself (the step's own
        strided rows; a plan of cuDNN's SDPA is kept per shape and strides)."""
        steps = list(super().profiled_steps(num_tokens))
        if not self.sdpa_applies:
            return tuple(steps)
        reached = {_sdpa_input(step.query_len) for step in steps
                   if self.is_sdpa_prompt(step.query_len, step.context_len)}
        query_len = max(self.min_sdpa_prompt_tokens, 2)
        while query_len <= num_tokens:
            rows = sdpa_padded_rows(query_len)
            for length in (query_len, rows):
                if length <= num_tokens and _sdpa_input(length) not in reached:
                    steps.append(ProfiledStep(length, 0))
                    reached.add(_sdpa_input(length))
            query_len = rows + 1
        return tuple(steps)


def _has_flash_sdpa(layout: AttentionLayout) -> bool:
    """Whether SDPA attends a causal prompt of `layout` without the math kernel: on CUDA, a
    16-bit dtype on compute capability 8.0 or newer; the CPU's own kernel takes any."""
    if layout.device.type != "cuda":
        return True
    return (layout.dtype in (torch.float16, torch.bfloat16)
            and torch.cuda.get_device_capability(layout.device) >= (8, 0))
