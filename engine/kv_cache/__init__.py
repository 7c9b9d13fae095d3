"""Paged KV cache bookkeeping (torch-free): blocks, the pool, prefix caching and pins."""

from engine.kv_cache.block import FreeBlockQueue, KVCacheBlock
from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.hashing import BlockHash, hash_block_tokens
from engine.kv_cache.manager import KVCacheManager, PrefixCacheStats
from engine.kv_cache.pins import Pin, PinReleaseReason, PinTable

__all__ = [
    "BlockHash",
    "BlockPool",
    "FreeBlockQueue",
    "KVCacheBlock",
    "KVCacheManager",
    "Pin",
    "PinReleaseReason",
    "PinTable",
    "PrefixCacheStats",
    "hash_block_tokens",
]
