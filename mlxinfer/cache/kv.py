"""Per-layer key/value caches, speaking mlx-lm's cache protocol.

The attention code of mlx-lm's layers calls `update_and_fetch(keys, values)` and
reads `offset`; a cache with a `bits` attribute gets quantized attention
(mlx-lm's `quantized_scaled_dot_product_attention`). Storage grows in steps so
decoding does not reallocate on every token. Sliding-window layers keep the full
history and are masked (models/decoder.py), which keeps every cache trimmable.

`state` is a tuple of arrays whose axis 2 is the position, so the prefix cache
can slice, store and restore any cache kind the same way.

A cache may hold several sequences as rows (cache/batch.py builds such batches
for continuous batching): rows are right-aligned, a shorter row starting after
`left_padding[row]` unused positions, and `offset` is then one position per row.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

STEP = 256  # positions added per growth


def _capacity(needed: int) -> int:
    return ((needed + STEP - 1) // STEP) * STEP


class _PositionCache:
    """Arrays with positions on axis 2, grown in steps; subclasses decide what the arrays hold."""

    def __init__(self) -> None:
        self.arrays: list[mx.array] = []
        self.length = 0  # positions written (in a batch: by the longest row, padding included)
        self.left_padding: list[int] | None = None  # per row, in a batch
        self._row_offsets: mx.array | None = None

    @property
    def offset(self) -> int | mx.array:
        """Where the next token sits: what RoPE rotates by (an array of one position per row in a batch)."""
        if self.left_padding is None:
            return self.length
        if self._row_offsets is None:
            self._row_offsets = mx.array([self.length - pad for pad in self.left_padding])
        return self._row_offsets

    def set_rows(self, arrays: list[mx.array], length: int, left_padding: list[int] | None) -> None:
        """Replace the contents (cache/batch.py reshapes batches with this)."""
        self.arrays, self.length, self.left_padding, self._row_offsets = arrays, length, left_padding, None

    def _append(self, parts: tuple[mx.array, ...]) -> tuple[mx.array, ...]:
        """Write `parts` after the current positions; returns every array up to the new end."""
        start, end = self.length, self.length + parts[0].shape[2]
        if not self.arrays or end > self.arrays[0].shape[2]:
            capacity = _capacity(end)
            olds = self.arrays or [None] * len(parts)
            self.arrays = [_grown(old, start, capacity, part) for old, part in zip(olds, parts)]
        for stored, part in zip(self.arrays, parts):
            stored[..., start:end, :] = part
        self.length, self._row_offsets = end, None
        return self.state

    def trim(self, n: int) -> int:
        """Forget the last `n` positions; returns how many were dropped."""
        n = min(self.length, n)
        self.length, self._row_offsets = self.length - n, None
        return n

    @property
    def state(self) -> tuple[mx.array, ...]:
        return tuple(a[..., : self.length, :] for a in self.arrays)

    def load_state(self, state: tuple[mx.array, ...]) -> None:
        """Start from `state` (a reused prefix); it is copied, never written, when the cache grows."""
        self.set_rows(list(state), state[0].shape[2], None)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


def _grown(old: mx.array | None, offset: int, capacity: int, like: mx.array) -> mx.array:
    new = mx.zeros((*like.shape[:2], capacity, like.shape[3]), like.dtype)
    if old is not None and offset:
        new[..., :offset, :] = old[..., :offset, :]
    return new


class KVCache(_PositionCache):
    """Keys and values of one attention layer, shape (B, kv_heads, T, head_dim)."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        stored_keys, stored_values = self._append((keys, values))
        return stored_keys, stored_values


class QuantizedKVCache(_PositionCache):
    """Keys and values stored as MLX affine-quantized triplets (packed, scales, biases) along head_dim."""

    def __init__(self, bits: int, group_size: int = 64):
        super().__init__()
        self.bits, self.group_size = bits, group_size

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        quantized = (
            *mx.quantize(keys, group_size=self.group_size, bits=self.bits),
            *mx.quantize(values, group_size=self.group_size, bits=self.bits),
        )
        stored = self._append(quantized)
        return stored[:3], stored[3:]


KV_BITS = (4, 8)


def held_positions(caches: Sequence[Cache]) -> int:
    """Positions every layer's cache holds.

    A forward pass stopped part-way (Ctrl-C) leaves its first layers ahead of the
    rest; each cache's `length` moves only after all its arrays were written, so
    the shortest one counts positions that are complete in every layer."""
    return min((c.length for c in caches), default=0)


Cache = KVCache | QuantizedKVCache


def make_cache(num_layers: int, kv_bits: int | None = None, group_size: int = 64) -> list[Cache]:
    """One empty cache per layer; `kv_bits` 8 or 4 stores keys and values quantized."""
    if kv_bits is None:
        return [KVCache() for _ in range(num_layers)]
    return [QuantizedKVCache(kv_bits, group_size) for _ in range(num_layers)]
