"""Fixed-size recurrent state of one layer: Gated DeltaNet, short convolutions, Mamba-2.

mlx-lm's recurrent layers read and write numbered slots (`cache[0]` the
convolution's last inputs, `cache[1]` the recurrent state) and call
`advance(n)` once they wrote all of them for n new positions. Writes are held
until that call, so a forward pass stopped part-way (Ctrl-C) never leaves one
slot a step ahead of the other: `length` and the slots always agree.

The state does not grow with the context, and it cannot be cut back to an
earlier position: the prefix cache keeps snapshots of it (the slot arrays
themselves: MLX arrays are never written in place, so keeping one is a copy).
In a batch each row's state is its own (axis 0); `length` and `left_padding`
follow the attention layers' positions so every layer agrees on the rows.
"""

from __future__ import annotations

import mlx.core as mx

from .kv import _RowCache


class StateCache(_RowCache):
    """Slot arrays of one recurrent layer, each with the batch on axis 0."""

    cuttable = False
    lengths = None  # mlx-lm's per-row lengths for padded prefill: our rows are prefilled one at a time

    def __init__(self) -> None:
        super().__init__()
        self.slots: list[mx.array | None] = []
        self._pending: dict[int, mx.array] = {}

    def __getitem__(self, slot: int) -> mx.array | None:
        return self.slots[slot] if slot < len(self.slots) else None

    def __setitem__(self, slot: int, value: mx.array) -> None:
        self._pending[slot] = value

    def make_mask(self, n: int) -> None:
        """mlx-lm's mask protocol (models/fallback.py): no padded rows to hide, each row runs alone."""
        return None

    def advance(self, n: int) -> None:
        """The layer wrote every slot for `n` new positions: make them the state."""
        for slot, value in sorted(self._pending.items()):
            self.slots.extend([None] * (slot + 1 - len(self.slots)))
            # A layer may store a slice of a chunk-sized array: a copy lets that buffer go (and snapshots stay small).
            self.slots[slot] = mx.contiguous(value)
        self._pending.clear()
        self.length, self._row_offsets = self.length + n, None

    @property
    def arrays(self) -> list[mx.array]:
        return [s for s in self.slots if s is not None]

    def set_rows(self, slots: list[mx.array | None], length: int, left_padding: list[int] | None) -> None:
        self.slots, self.length, self.left_padding, self._row_offsets = list(slots), length, left_padding, None
        self._pending.clear()

    def snapshot(self) -> tuple[mx.array | None, ...]:
        mx.eval(self.arrays)
        return tuple(self.slots)

    def load_state(self, state: tuple[mx.array | None, ...], length: int | None = None) -> None:
        if length is None:
            raise ValueError("a recurrent state is restored at a known position; pass length")
        self.set_rows(list(state), length, None)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)
