"""Applies the step's grammar bitmask to the logits of the rows it constrains, on the device.

The bitmask reaches the device packed (a bit a token, copied without waiting for the device)
and is unpacked there, so neither the host nor the copy handles a byte a token.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.sample.metadata import GrammarRows


def allowed_tokens(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, vocab_size] bool from packed int32 `words` [rows, >= vocab_size / 32]: token `t`
    allowed when bit `t % 32` of word `t // 32` is set."""
    if words.shape[1] * 32 < vocab_size:
        raise ValueError(f"a bitmask of {words.shape[1]} words cannot cover {vocab_size} tokens")
    if words.device.type == "cpu":
        # numpy's unpacking is several times faster than torch's bit operations on a CPU.
        return unpack_with_numpy(words, vocab_size)
    return unpack_with_torch(words, vocab_size)


def unpack_with_torch(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`allowed_tokens` by torch's bit operations, on the words' device."""
    # Little-endian bytes: byte `t // 8` of a row holds token `t` at bit `t % 8`.
    packed = words.contiguous().view(torch.uint8)
    one = torch.ones(8, dtype=torch.uint8, device=words.device)
    bit_values = one << torch.arange(8, dtype=torch.uint8, device=words.device)
    return (packed.unsqueeze(-1) & bit_values).ne(0).flatten(start_dim=1)[:, :vocab_size]


def unpack_with_numpy(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`allowed_tokens` by numpy (the words on the CPU)."""
    packed = words.contiguous().numpy().view(np.uint8)
    bits = np.unpackbits(packed, axis=1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(bits.view(np.bool_))


def apply_grammar(logits: torch.Tensor, grammar: GrammarRows) -> torch.Tensor:
    """A new tensor: `logits` with the tokens its grammar forbids at minus infinity in each
    constrained row (other rows unchanged)."""
    forbidden = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    forbidden.index_put_((grammar.rows,), ~allowed_tokens(grammar.words, logits.shape[1]))
    return logits.masked_fill(forbidden, float("-inf"))
