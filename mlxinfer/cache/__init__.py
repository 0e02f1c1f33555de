"""Attention caches: the per-layer KV cache, the prompt-prefix cache over it, and its disk store."""

from .kv import KV_BITS, Cache, KVCache, QuantizedKVCache, held_positions, make_cache
from .prefix import PrefixCache, PrefixCacheStats, PrefixHit
from .store import PrefixStore, clear_prefixes, fingerprint, list_prefixes

__all__ = [
    "KV_BITS",
    "Cache",
    "QuantizedKVCache",
    "KVCache",
    "PrefixCache",
    "PrefixCacheStats",
    "PrefixHit",
    "PrefixStore",
    "clear_prefixes",
    "fingerprint",
    "held_positions",
    "list_prefixes",
    "make_cache",
]
