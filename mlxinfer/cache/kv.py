"""Per-layer key/value caches, speaking mlx-lm's cache protocol.

The attention code of mlx-lm's layers calls `update_and_fetch(keys, values)` and
reads `offset`; a cache with a `bits` attribute gets quantized attention
(mlx-lm's `quantized_scaled_dot_product_attention`). Storage grows in steps so
decoding does not reallocate on every token. Sliding-window layers keep the full
history and are masked (models/decoder.py), which keeps every cache trimmable.

`state` is a tuple of arrays whose axis 2 is the position, so the prefix cache
can slice, store and restore any cache kind the same way.
"""

from __future__ import annotations

import mlx.core as mx

STEP = 256  # positions added per growth


def _capacity(needed: int) -> int:
    return ((needed + STEP - 1) // STEP) * STEP


def _grown(old: mx.array | None, offset: int, shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    new = mx.zeros(shape, dtype)
    if old is not None and offset:
        new[..., :offset, :] = old[..., :offset, :]
    return new


class KVCache:
    """Keys and values of one attention layer, shape (B, kv_heads, T, head_dim)."""

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        start, length = self.offset, keys.shape[2]
        if self.keys is None or start + length > self.keys.shape[2]:
            capacity = _capacity(start + length)
            self.keys = _grown(self.keys, start, (*keys.shape[:2], capacity, keys.shape[3]), keys.dtype)
            self.values = _grown(self.values, start, (*values.shape[:2], capacity, values.shape[3]), values.dtype)
        self.offset = start + length
        self.keys[..., start : self.offset, :] = keys
        self.values[..., start : self.offset, :] = values
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    def trim(self, n: int) -> int:
        """Forget the last `n` positions; returns how many were dropped."""
        n = min(self.offset, n)
        self.offset -= n
        return n

    @property
    def state(self) -> tuple[mx.array, ...]:
        assert self.keys is not None and self.values is not None
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    def load_state(self, state: tuple[mx.array, ...]) -> None:
        """Start from `state` (a reused prefix); it is copied, never written, when the cache grows."""
        self.keys, self.values = state
        self.offset = state[0].shape[2]

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None or self.values is None else self.keys.nbytes + self.values.nbytes


class QuantizedKVCache:
    """Keys and values stored as MLX affine-quantized triplets (packed, scales, biases) along head_dim."""

    def __init__(self, bits: int, group_size: int = 64):
        self.bits, self.group_size = bits, group_size
        self.keys: list[mx.array] | None = None
        self.values: list[mx.array] | None = None
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        start, length = self.offset, keys.shape[2]
        new_k = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        new_v = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        if self.keys is None or start + length > self.keys[0].shape[2]:
            capacity = _capacity(start + length)
            self.keys = [self._grow(old, new, start, capacity) for old, new in zip(self.keys or [None] * 3, new_k)]
            self.values = [self._grow(old, new, start, capacity) for old, new in zip(self.values or [None] * 3, new_v)]
        self.offset = start + length
        for stored, new in zip(self.keys + self.values, (*new_k, *new_v)):
            stored[..., start : self.offset, :] = new
        return self._fetch(self.keys), self._fetch(self.values)

    def _grow(self, old: mx.array | None, new: mx.array, offset: int, capacity: int) -> mx.array:
        return _grown(old, offset, (*new.shape[:2], capacity, new.shape[3]), new.dtype)

    def _fetch(self, triplet: list[mx.array]) -> tuple[mx.array, ...]:
        return tuple(x[..., : self.offset, :] for x in triplet)

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n

    @property
    def state(self) -> tuple[mx.array, ...]:
        assert self.keys is not None and self.values is not None
        return (*self._fetch(self.keys), *self._fetch(self.values))

    def load_state(self, state: tuple[mx.array, ...]) -> None:
        self.keys, self.values = list(state[:3]), list(state[3:])
        self.offset = state[0].shape[2]

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None or self.values is None else sum(x.nbytes for x in self.keys + self.values)


KV_BITS = (4, 8)


Cache = KVCache | QuantizedKVCache


def make_cache(num_layers: int, kv_bits: int | None = None, group_size: int = 64) -> list[Cache]:
    """One empty cache per layer; `kv_bits` 8 or 4 stores keys and values quantized."""
    if kv_bits is None:
        return [KVCache() for _ in range(num_layers)]
    return [QuantizedKVCache(kv_bits, group_size) for _ in range(num_layers)]
