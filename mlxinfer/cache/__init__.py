"""Attention caches: the per-layer KV cache and the prompt-prefix cache over it."""

from .kv import KVCache, make_cache
from .prefix import PrefixCache, PrefixCacheStats, PrefixHit

__all__ = ["KVCache", "PrefixCache", "PrefixCacheStats", "PrefixHit", "make_cache"]
