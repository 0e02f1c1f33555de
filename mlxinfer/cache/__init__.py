"""Attention caches: the per-layer KV cache used by the engine."""

from .kv import KVCache, make_cache

__all__ = ["KVCache", "make_cache"]
