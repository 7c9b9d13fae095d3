"""Each row's kept threshold for top-k and top-p found on the device without a sort: a radix
select over the logits' bits, one Triton program a row.

The threshold is `top_k_top_p`'s: the larger of the row's `k`-th largest logit and its top-p
cut over the tokens top-k leaves (the logit of the first token, in descending order, at which
the cumulative probability reaches `p`), ties kept whole. Both are the largest logit `t`
whose tokens at or above `t` reach a target, a count (`k`) or a mass (`p` times the mass
top-k leaves). A float32's bits, the sign flipped or every bit inverted, order like its value
(`_order_bits`), so `t` is found four bits at a time from the top: a pass over the row sums
the weight of each value of the next four bits among the tokens whose higher bits match the
ones chosen so far, and takes the first value, from the top, at which the weight so far
reaches the target. Eight passes settle a cut; a top-p alone reads the row nine times (one for its
largest logit), and never waits for the device: `search="sort"` sorted each row whole.

A token's probability is `exp(logit - top)` in float32, as the sort path's. A thread adds
its tokens' weights by digit in float32 over `_CHUNKS_PER_SUM` chunks (8 tokens a sum), then
the threads' sums meet in float64 (the sort path sums every token in float64). Where the
sums fall short of the target by a rounding, digit 0 is taken: the most tokens kept, as the
sort path then keeps its last candidate.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.model.triton_interpreter import mend_interpreter

if triton.knobs.runtime.interpret:
    mend_interpreter()

_BLOCK = 512  # tokens a program reads at once
_CHUNKS_PER_SUM = 8  # chunks whose weights a thread adds in float32


def radix_cuts(logits: torch.Tensor, top_k: torch.Tensor | None,
               top_p: torch.Tensor | None) -> torch.Tensor:
    """Each row's smallest kept logit [rows] (minus infinity: every one) for `logits` [rows,
    vocab] float32, `top_k` [rows] int64 (the vocabulary's size where disabled) and `top_p`
    [rows] float32 (1 where disabled). Needs CUDA, or the interpreter on CPU tensors."""
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"expected float32 logits [rows, vocab], got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    num_rows, vocab_size = logits.shape
    for name, values in (("top_k", top_k), ("top_p", top_p)):
        if values is not None and values.shape != (num_rows,):
            raise ValueError(f"{name} has shape {tuple(values.shape)}, expected ({num_rows},)")
    cuts = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    if num_rows == 0:
        return cuts
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    # Both filters always, a disabled one at its "keep all": one compiled kernel, which the
    # runner's start-up memory profile compiles.
    if top_k is None:
        top_k = torch.full((num_rows,), vocab_size, dtype=torch.int64, device=logits.device)
    if top_p is None:
        top_p = torch.ones(num_rows, dtype=torch.float32, device=logits.device)
    _cut_kernel[(num_rows,)](logits, logits.stride(0), vocab_size, top_k, top_p, cuts,
                             BLOCK=_BLOCK, CHUNKS_PER_SUM=_CHUNKS_PER_SUM, num_warps=8)
    return cuts


@triton.jit
def _order_bits(x):
    """int32 bits of float32 `x` whose unsigned order is the values' order (minus infinity
    lowest): a positive value's sign bit set, a negative one's every bit inverted."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, ~bits, bits | -2147483648)


@triton.jit
def _value_of(order_bits):
    """The float32 whose `_order_bits` are `order_bits`."""
    bits = tl.where(order_bits < 0, order_bits & 2147483647, ~order_bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _digit_weights(row_ptr, vocab_size, floor, top, prefix, shift, BY_MASS: tl.constexpr,
                   BLOCK: tl.constexpr, CHUNKS_PER_SUM: tl.constexpr):
    """[16] float64: the weight of the tokens at or above `floor` whose order bits above
    `shift + 4` are `prefix`, by the value of their four bits from `shift`; a token weighs
    its mass relative to `top` (`BY_MASS`) or one."""
    digits = tl.arange(0, 16)
    weights = tl.zeros([16], dtype=tl.float64)
    for first in range(0, vocab_size, BLOCK * CHUNKS_PER_SUM):
        # Each thread adds its own tokens' weights by digit; the threads' sums meet once a
        # `CHUNKS_PER_SUM` chunks, in float64.
        by_digit = tl.zeros([BLOCK, 16], dtype=tl.float32)
        for start in range(first, tl.minimum(first + BLOCK * CHUNKS_PER_SUM, vocab_size),
                           BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            x = tl.load(row_ptr + offsets, mask=offsets < vocab_size, other=float("-inf"))
            key = _order_bits(x)
            # Shifted by `shift`, then by 4: a shift by 32 (the first pass's) is undefined.
            high = ((key >> shift) >> 4) & ((1 << (28 - shift)) - 1)
            counted = (offsets < vocab_size) & (x >= floor) & (high == prefix)
            if BY_MASS:
                weight = tl.where(counted, tl.exp2((x - top) * 1.4426950408889634), 0.0)
            else:
                weight = counted.to(tl.float32)
            digit = (key >> shift) & 15
            by_digit += tl.where(digit[:, None] == digits[None, :], weight[:, None], 0.0)
        weights += tl.sum(by_digit.to(tl.float64), axis=0)
    return weights


@triton.jit
def _choose_digit(weights, above, target):
    """The highest digit at which `above` (the weight of the tokens above every digit) and
    the weights from the top digit down reach `target`, or 0 if none does; and the weight
    above that digit."""
    digits = tl.arange(0, 16)
    from_top = above + tl.sum(
        tl.where(digits[None, :] >= digits[:, None], weights[None, :], 0.0), axis=1)
    digit = tl.maximum(tl.sum((from_top >= target).to(tl.int32)) - 1, 0)
    return digit, above + tl.sum(tl.where(digits > digit, weights, 0.0))


@triton.jit
def _select(row_ptr, vocab_size, floor, top, goal, BY_MASS: tl.constexpr,
            BLOCK: tl.constexpr, CHUNKS_PER_SUM: tl.constexpr):
    """The largest logit t at or above `floor` whose tokens at or above it reach the
    target: `goal` tokens, or (`BY_MASS`) the share `goal` of the mass at or above
    `floor`."""
    weights = _digit_weights(row_ptr, vocab_size, floor, top, 0, 28, BY_MASS, BLOCK,
                             CHUNKS_PER_SUM)
    target = goal.to(tl.float64)
    if BY_MASS:
        target *= tl.sum(weights)
    digit, above = _choose_digit(weights, 0.0, target)
    prefix = digit
    for step in range(1, 8):  # not unrolled: a short kernel to compile
        weights = _digit_weights(row_ptr, vocab_size, floor, top, prefix, 28 - 4 * step,
                                 BY_MASS, BLOCK, CHUNKS_PER_SUM)
        digit, above = _choose_digit(weights, above, target)
        prefix = (prefix << 4) | digit
    return _value_of(prefix)


@triton.jit
def _cut_kernel(logits_ptr, stride_row, vocab_size, top_k_ptr, top_p_ptr, cut_ptr,
                BLOCK: tl.constexpr, CHUNKS_PER_SUM: tl.constexpr):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    cut = tl.full([], float("-inf"), tl.float32)
    k = tl.load(top_k_ptr + row)
    if k < vocab_size:
        cut = _select(row_ptr, vocab_size, cut, 0.0, k, False, BLOCK, CHUNKS_PER_SUM)
    p = tl.load(top_p_ptr + row)
    if p < 1.0:
        top = tl.full([], float("-inf"), tl.float32)
        for start in range(0, vocab_size, BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            x = tl.load(row_ptr + offsets, mask=offsets < vocab_size, other=float("-inf"))
            top = tl.maximum(top, tl.max(x))
        cut = _select(row_ptr, vocab_size, cut, top, p, True, BLOCK, CHUNKS_PER_SUM)
    tl.store(cut_ptr + row, cut)
