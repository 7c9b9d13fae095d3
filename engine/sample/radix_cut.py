"""Each row's kept threshold for top-k and top-p found on the device without a sort: a radix
select over the logits' bits, one Triton program a row.

The threshold is `top_k_top_p`'s: the larger of the row's `k`-th largest logit and its top-p
cut over the tokens top-k leaves (the logit of the first token, in descending order, at which
the cumulative probability reaches `p`), ties kept whole. Both are the largest logit `t`
whose tokens at or above `t` reach a target, a count (`k`) or a mass (`p` times the mass
top-k leaves). A float32's bits, the sign flipped or every bit inverted, order like its value
(`_order_bits`), so `t` is found a few bits at a time from the top (`DIGIT_BITS`, 4: a
digit): a pass over the row sums the weight of each value of the next digit among the
tokens whose higher bits match the digits chosen so far, and takes the first value, from the
top, at which the weight so far reaches the target. Eight passes of 4 bits settle a cut; a
top-p alone reads its row once more for its largest logit. Unlike the sort path's search of
the CPU (`binned`), nothing is read back on the host, so no step waits for the device.

Logits must be finite or minus infinity. A token's probability is `exp2((logit - top) *
log2(e))` in float32 (on a GPU its fast approximation, within a few units in the last place
of the sort path's `exp`). A thread adds its tokens' weights by digit in float32 over
`CHUNKS_PER_SUM` chunks (8 tokens a sum), then the threads' sums meet in float64 (the sort
path sums every token in float64). Counts are exact; a top-p cut can differ from the sort
path's by the one token at the crossing when the target lies within those roundings of a
token's cumulative mass. Where the sums of a pass fall short of the target by a rounding
(never from the top: every digit's weight is summed alike), digit 0 is taken: the whole
group of tokens at the current digits is kept.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.model.triton_interpreter import mend_interpreter
from engine.model.triton_support import check_triton_runs_on

if triton.knobs.runtime.interpret:
    mend_interpreter()

DIGIT_BITS = 4  # bits a pass settles
SUPPORTED_DIGIT_BITS = (2, 4)
BLOCK = 512  # tokens a program reads at once
CHUNKS_PER_SUM = 8  # chunks whose weights a thread adds in float32


def radix_cuts(logits: torch.Tensor, top_k: torch.Tensor | None,
               top_p: torch.Tensor | None, *, digit_bits: int = DIGIT_BITS) -> torch.Tensor:
    """Each row's smallest kept logit [rows] (minus infinity: every one) for `logits` [rows,
    vocab] float32, `top_k` [rows] int64 (the vocabulary's size where disabled) and `top_p`
    [rows] float32 (1 where disabled); `digit_bits` a pass (`SUPPORTED_DIGIT_BITS`: 4 takes
    8 passes of 16 sums a token, 2 takes 16 of 4). Needs CUDA, or the interpreter on CPU
    tensors. Allocates the cuts, a disabled filter's row of "keep all", and a contiguous
    copy of logits whose tokens are strided."""
    check_triton_runs_on(logits.device, "the radix top-k/top-p search")
    if digit_bits not in SUPPORTED_DIGIT_BITS:
        raise ValueError(f"digit_bits must be one of {SUPPORTED_DIGIT_BITS}, got {digit_bits}")
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
    # Both filters always, a disabled one at its "keep all": one compiled kernel a digit
    # width, which the runner's start-up memory profile compiles when CUDA takes this search.
    if top_k is None:
        top_k = torch.full((num_rows,), vocab_size, dtype=torch.int64, device=logits.device)
    if top_p is None:
        top_p = torch.ones(num_rows, dtype=torch.float32, device=logits.device)
    _cut_kernel[(num_rows,)](logits, logits.stride(0), vocab_size, top_k, top_p, cuts,
                             DIGIT_BITS=digit_bits, BLOCK=BLOCK, CHUNKS_PER_SUM=CHUNKS_PER_SUM,
                             num_warps=8)
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
                   DIGIT_BITS: tl.constexpr, BLOCK: tl.constexpr,
                   CHUNKS_PER_SUM: tl.constexpr):
    """[2**DIGIT_BITS] float64: the weight of the tokens at or above `floor` whose order bits
    above `shift + DIGIT_BITS` are `prefix`, by the value of their digit from `shift`; a
    token weighs its mass relative to `top` (`BY_MASS`) or one."""
    digits = tl.arange(0, 1 << DIGIT_BITS)
    weights = tl.zeros([1 << DIGIT_BITS], dtype=tl.float64)
    for first in range(0, vocab_size, BLOCK * CHUNKS_PER_SUM):
        # Each thread adds its own tokens' weights by digit; the threads' sums meet once a
        # `CHUNKS_PER_SUM` chunks, in float64.
        by_digit = tl.zeros([BLOCK, 1 << DIGIT_BITS], dtype=tl.float32)
        for start in range(first, tl.minimum(first + BLOCK * CHUNKS_PER_SUM, vocab_size),
                           BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            x = tl.load(row_ptr + offsets, mask=offsets < vocab_size, other=float("-inf"))
            key = _order_bits(x)
            # Shifted by `shift`, then by a digit: one shift by 32 (the first pass's) is
            # undefined. The mask drops what the arithmetic shift of a negative int copies.
            high = ((key >> shift) >> DIGIT_BITS) & ((1 << (32 - DIGIT_BITS - shift)) - 1)
            counted = (offsets < vocab_size) & (x >= floor) & (high == prefix)
            if BY_MASS:
                weight = tl.where(counted, tl.exp2((x - top) * 1.4426950408889634), 0.0)
            else:
                weight = counted.to(tl.float32)
            digit = (key >> shift) & ((1 << DIGIT_BITS) - 1)
            by_digit += tl.where(digit[:, None] == digits[None, :], weight[:, None], 0.0)
        weights += tl.sum(by_digit.to(tl.float64), axis=0)
    return weights


@triton.jit
def _choose_digit(weights, above, target, DIGIT_BITS: tl.constexpr):
    """The highest digit at which `above` (the weight of the tokens above every digit) and
    the weights from the top digit down reach `target`, or 0 if none does; and the weight
    above that digit."""
    digits = tl.arange(0, 1 << DIGIT_BITS)
    from_top = above + tl.sum(
        tl.where(digits[None, :] >= digits[:, None], weights[None, :], 0.0), axis=1)
    digit = tl.maximum(tl.sum((from_top >= target).to(tl.int32)) - 1, 0)
    return digit, above + tl.sum(tl.where(digits > digit, weights, 0.0))


@triton.jit
def _select(row_ptr, vocab_size, floor, top, goal, BY_MASS: tl.constexpr,
            DIGIT_BITS: tl.constexpr, BLOCK: tl.constexpr, CHUNKS_PER_SUM: tl.constexpr):
    """The largest logit t at or above `floor` whose tokens at or above it reach the
    target: `goal` tokens, or (`BY_MASS`) the share `goal` of the mass at or above
    `floor`."""
    weights = _digit_weights(row_ptr, vocab_size, floor, top, 0, 32 - DIGIT_BITS, BY_MASS,
                             DIGIT_BITS, BLOCK, CHUNKS_PER_SUM)
    target = goal.to(tl.float64)
    if BY_MASS:
        target *= tl.sum(weights)
    digit, above = _choose_digit(weights, 0.0, target, DIGIT_BITS)
    prefix = digit
    for step in range(2, 32 // DIGIT_BITS + 1):  # not unrolled: a short kernel to compile
        weights = _digit_weights(row_ptr, vocab_size, floor, top, prefix,
                                 32 - DIGIT_BITS * step, BY_MASS, DIGIT_BITS, BLOCK,
                                 CHUNKS_PER_SUM)
        digit, above = _choose_digit(weights, above, target, DIGIT_BITS)
        prefix = (prefix << DIGIT_BITS) | digit
    return _value_of(prefix)


@triton.jit
def _cut_kernel(logits_ptr, stride_row, vocab_size, top_k_ptr, top_p_ptr, cut_ptr,
                DIGIT_BITS: tl.constexpr, BLOCK: tl.constexpr, CHUNKS_PER_SUM: tl.constexpr):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    cut = tl.full([], float("-inf"), tl.float32)
    k = tl.load(top_k_ptr + row)
    if k < vocab_size:
        cut = _select(row_ptr, vocab_size, cut, 0.0, k, False, DIGIT_BITS, BLOCK,
                      CHUNKS_PER_SUM)
    p = tl.load(top_p_ptr + row)
    if p < 1.0:
        top = tl.full([], float("-inf"), tl.float32)
        for start in range(0, vocab_size, BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            x = tl.load(row_ptr + offsets, mask=offsets < vocab_size, other=float("-inf"))
            top = tl.maximum(top, tl.max(x))
        cut = _select(row_ptr, vocab_size, cut, top, p, True, DIGIT_BITS, BLOCK,
                      CHUNKS_PER_SUM)
    tl.store(cut_ptr + row, cut)
