"""Per-layer key/value cache, speaking mlx-lm's cache protocol.

The attention code of mlx-lm's layers calls `update_and_fetch(keys, values)` and
reads `offset`; that is the whole contract. Storage grows in steps so decoding
does not reallocate on every token. Sliding-window layers keep the full history
and are masked (models/decoder.py), which keeps the cache trimmable.
"""

from __future__ import annotations

import mlx.core as mx


class KVCache:
    """Keys and values of one attention layer, shape (B, kv_heads, T, head_dim)."""

    step = 256

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    @classmethod
    def from_state(cls, keys: mx.array, values: mx.array) -> KVCache:
        """A cache that starts with `keys`/`values` (a reused prefix); they are copied, not written, on growth."""
        cache = cls()
        cache.keys, cache.values, cache.offset = keys, values, keys.shape[2]
        return cache

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        start, length = self.offset, keys.shape[2]
        if self.keys is None or start + length > self.keys.shape[2]:
            self._grow(keys, values, start + length)
        self.offset = start + length
        self.keys[..., start : self.offset, :] = keys
        self.values[..., start : self.offset, :] = values
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    def _grow(self, keys: mx.array, values: mx.array, needed: int) -> None:
        capacity = ((needed + self.step - 1) // self.step) * self.step
        batch, heads, _, k_dim = keys.shape
        new_k = mx.zeros((batch, heads, capacity, k_dim), keys.dtype)
        new_v = mx.zeros((batch, heads, capacity, values.shape[3]), values.dtype)
        if self.keys is not None:
            new_k[..., : self.offset, :] = self.keys[..., : self.offset, :]
            new_v[..., : self.offset, :] = self.values[..., : self.offset, :]
        self.keys, self.values = new_k, new_v

    def trim(self, n: int) -> int:
        """Forget the last `n` positions; returns how many were dropped."""
        n = min(self.offset, n)
        self.offset -= n
        return n

    @property
    def state(self) -> tuple[mx.array, mx.array]:
        assert self.keys is not None and self.values is not None
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    @property
    def nbytes(self) -> int:
        if self.keys is None or self.values is None:
            return 0
        return self.keys.nbytes + self.values.nbytes


def make_cache(num_layers: int) -> list[KVCache]:
    """One empty cache per layer."""
    return [KVCache() for _ in range(num_layers)]
