"""Paged KV cache bookkeeping (no torch): block pool, prefix hashes, per-request block lists."""

from servelm.engine.kv_cache.block_pool import BlockPool, KVBlock, hash_block_tokens
from servelm.engine.kv_cache.manager import KVCacheManager, PrefixCacheStats, kv_window

__all__ = [
    "BlockPool",
    "KVBlock",
    "KVCacheManager",
    "PrefixCacheStats",
    "hash_block_tokens",
    "kv_window",
]
