"""Per-layer key/value caches, speaking mlx-lm's cache protocol.

The attention code of mlx-lm's layers calls `update_and_fetch(keys, values)` and
reads `offset`; a cache with a `bits` attribute gets quantized attention
(mlx-lm's `quantized_scaled_dot_product_attention`). Storage grows in steps so
decoding does not reallocate on every token.

A full-attention cache holds every position, so it can be cut at any length
(`cuttable`): the prefix cache slices it. A sliding-window cache (`window` set)
holds only positions [start, length): once a write would outgrow its storage it
keeps the last `window - 1` positions (all a later query can see) and drops the
rest, so its memory stays near the window plus one prefill chunk however long
the context gets. It cannot be cut back: the prefix cache keeps snapshots of it.

`state` is a tuple of arrays whose axis 2 is the position (from `start`).

A cache may hold several sequences as rows (cache/batch.py builds such batches
for continuous batching): rows are right-aligned, a shorter row starting after
`left_padding[row]` unused positions, and `offset` is then one position per row.
"""

from __future__ import annotations

import mlx.core as mx

STEP = 256  # positions added per growth


def _capacity(needed: int) -> int:
    return ((needed + STEP - 1) // STEP) * STEP


class _RowCache:
    """What every layer cache shares: positions written, and the rows of a batch."""

    def __init__(self) -> None:
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


class _PositionCache(_RowCache):
    """Arrays with positions on axis 2, grown in steps; subclasses decide what the arrays hold."""

    def __init__(self, window: int | None = None, positions: int | None = None) -> None:
        super().__init__()
        self.arrays: list[mx.array] = []
        self.start = 0  # the position arrays[..., 0, :] holds (a window drops older ones)
        self.window = window
        # Positions a full-attention cache makes room for at its first growth: a request's known prompt (and a
        # step of its answer), so a long prefill writes into one allocation instead of copying its history once
        # per STEP it passes. A window stays near its own size whatever comes.
        self.positions = positions if window is None else None

    @property
    def cuttable(self) -> bool:
        """Whether the first n positions can be taken for any n (a window forgets old ones)."""
        return self.window is None

    def set_rows(self, arrays: list[mx.array], length: int, left_padding: list[int] | None, start: int = 0) -> None:
        """Replace the contents (cache/batch.py reshapes batches with this)."""
        self.arrays, self.length, self.left_padding, self._row_offsets = arrays, length, left_padding, None
        self.start = start

    def key_start(self, new: int) -> int:
        """The position of the first key `update_and_fetch` returns when `new` positions are written next."""
        if self.window is None or not self.arrays or self.length - self.start + new <= self.arrays[0].shape[2]:
            return self.start
        return max(self.start, self.length - (self.window - 1))

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> mx.array | None:
        """mlx-lm's mask protocol, for models whose own `__call__` builds masks from their caches (the
        unverified fallback, models/fallback.py): `n` queries after `length` over the keys the next
        `update_and_fetch` returns. One sequence: such models are never batched."""
        window = window_size or self.window
        start = self.key_start(n)
        if n == 1 and not return_array and (window is None or self.length + 1 - start <= window):
            return None
        query = mx.arange(self.length, self.length + n)[:, None]
        key = mx.arange(start, self.length + n)[None]
        mask = query >= key
        return mask & (query < key + window) if window else mask

    def _append(self, parts: tuple[mx.array, ...]) -> tuple[mx.array, ...]:
        """Write `parts` after the current positions; returns every array from `start` to the new end."""
        new = parts[0].shape[2]
        if not self.arrays or self.length - self.start + new > self.arrays[0].shape[2]:
            self._regrow(new, parts)
        at = self.length - self.start
        for stored, part in zip(self.arrays, parts):
            stored[..., at : at + new, :] = part
        self.length, self._row_offsets = self.length + new, None
        return self.state

    def _regrow(self, new: int, like: tuple[mx.array, ...]) -> None:
        """Fresh storage with room for `new` more positions, keeping what later queries can still see."""
        start = self.key_start(new)
        kept = self.length - start
        # A window gets a step of slack so decoding regrows once per STEP tokens, not every token.
        capacity = _capacity(max(kept + new, self.positions or 0)) + (STEP if self.window is not None else 0)
        self.positions = None  # once: past it, growth is in steps again
        olds = self.arrays or [None] * len(like)
        self.arrays = [_moved(old, start - self.start, kept, capacity, part) for old, part in zip(olds, like)]
        self.start = start

    def trim(self, n: int) -> int:
        """Forget the last `n` positions (never before `start`); returns how many were dropped."""
        n = min(self.length - self.start, n)
        self.length, self._row_offsets = self.length - n, None
        return n

    @property
    def state(self) -> tuple[mx.array, ...]:
        return tuple(a[..., : self.length - self.start, :] for a in self.arrays)

    def load_state(self, state: tuple[mx.array, ...], length: int | None = None) -> None:
        """Start from `state` (a reused prefix, or a window's snapshot ending at `length`).

        It is copied, never written, when the cache grows."""
        held = state[0].shape[2]
        length = held if length is None else length
        self.set_rows(list(state), length, None, start=length - held)

    def snapshot(self) -> tuple[mx.array, ...]:
        """A copy of what a window still needs (its last window - 1 positions), to restore with load_state."""
        keep = min(self.length - self.start, (self.window or self.length + 1) - 1)
        copied = tuple(mx.contiguous(a[..., self.length - self.start - keep : self.length - self.start, :])
                       for a in self.arrays)  # fmt: skip
        mx.eval(copied)
        return copied

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


def _moved(old: mx.array | None, first: int, kept: int, capacity: int, like: mx.array) -> mx.array:
    """New storage of `capacity` positions starting with `old[..., first : first + kept, :]`."""
    new = mx.zeros((*like.shape[:2], capacity, like.shape[3]), like.dtype)
    if old is not None and kept:
        new[..., :kept, :] = old[..., first : first + kept, :]
    return new


class KVCache(_PositionCache):
    """Keys and values of one attention layer, shape (B, kv_heads, T, head_dim)."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        stored_keys, stored_values = self._append((keys, values))
        return stored_keys, stored_values


class QuantizedKVCache(_PositionCache):
    """Keys and values stored as MLX affine-quantized triplets (packed, scales, biases) along head_dim."""

    def __init__(self, bits: int, group_size: int = 64, window: int | None = None, positions: int | None = None):
        super().__init__(window, positions)
        self.bits, self.group_size = bits, group_size

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        quantized = (
            *mx.quantize(keys, group_size=self.group_size, bits=self.bits),
            *mx.quantize(values, group_size=self.group_size, bits=self.bits),
        )
        stored = self._append(quantized)
        return stored[:3], stored[3:]


KV_BITS = (4, 8)
