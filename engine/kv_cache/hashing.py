"""Collision-safe chained hashing of full KV blocks for prefix caching.

A block's hash covers its parent's hash, its token ids and any extra keys (for example a cache
salt), so equal hashes mean equal prefixes. SHA-256 over an unambiguous byte encoding is used:
a collision would silently reuse another prompt's KV, so a fast non-cryptographic hash is not
good enough.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.request import Request

BlockHash = bytes

_ROOT_HASH: BlockHash = hashlib.sha256(b"continuum/kv-block-root/v1").digest()

ExtraKeys = tuple[str | int | bytes, ...]


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: ExtraKeys | None = None,
) -> BlockHash:
    """Hash of one full block given its parent's hash (`None` for the first block)."""
    digest = hashlib.sha256(_ROOT_HASH if parent_hash is None else parent_hash)
    digest.update(len(token_ids).to_bytes(4, "little"))
    digest.update(array("Q", token_ids).tobytes())
    if extra_keys:
        digest.update(repr(extra_keys).encode())
    return digest.digest()


def extend_block_hashes(request: Request, block_size: int) -> list[BlockHash]:
    """Extends `request.block_hashes` to cover every full block of its tokens; returns it."""
    hashes = request.block_hashes
    num_full_blocks = request.num_tokens // block_size
    if len(hashes) >= num_full_blocks:
        return hashes
    token_ids = request.all_token_ids
    parent = hashes[-1] if hashes else None
    for index in range(len(hashes), num_full_blocks):
        start = index * block_size
        extra = (request.cache_salt,) if index == 0 and request.cache_salt else None
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], extra)
        hashes.append(parent)
    return hashes
