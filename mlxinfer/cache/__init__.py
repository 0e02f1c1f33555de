"""Layer caches (attention KV, sliding windows, recurrent state), the prefix cache over them, and its disk store."""

from .kv import KV_BITS, KVCache, QuantizedKVCache
from .layers import FULL, RECURRENT, SLIDING, Cache, LayerKind, held_positions, make_cache, snapshot
from .prefix import PrefixCache, PrefixCacheStats, PrefixHit, Snapshot
from .state import StateCache
from .store import PrefixStore, clear_prefixes, fingerprint, list_prefixes

__all__ = [
    "FULL",
    "KV_BITS",
    "RECURRENT",
    "SLIDING",
    "Cache",
    "KVCache",
    "LayerKind",
    "PrefixCache",
    "PrefixCacheStats",
    "PrefixHit",
    "PrefixStore",
    "Snapshot",
    "QuantizedKVCache",
    "StateCache",
    "clear_prefixes",
    "fingerprint",
    "held_positions",
    "list_prefixes",
    "make_cache",
    "snapshot",
]
