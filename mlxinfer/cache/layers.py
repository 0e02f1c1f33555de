"""One cache per layer, of the kind the layer needs, from the model's layer types.

The layer types are transformers' names: full attention keeps every position,
sliding attention a window, and the recurrent kinds (Gated DeltaNet linear
attention, short convolutions, Mamba-2) a fixed-size state.
"""

from __future__ import annotations

from collections.abc import Sequence

from .kv import KVCache, QuantizedKVCache
from .state import StateCache

FULL, SLIDING = "full_attention", "sliding_attention"
RECURRENT = frozenset({"linear_attention", "conv", "mamba"})

Cache = KVCache | QuantizedKVCache | StateCache
LayerKind = tuple[str, "int | None"]  # (layer type, sliding window or None)


def make_cache(
    kinds: Sequence[LayerKind], kv_bits: int | None = None, group_size: int = 64, positions: int | None = None
) -> list[Cache]:
    """One empty cache per layer; `kv_bits` 8 or 4 stores attention keys and values quantized; `positions`: what
    full-attention layers make room for at once (a prompt's length), instead of growing to it step by step."""
    return [_one(kind, window, kv_bits, group_size, positions) for kind, window in kinds]


def _one(kind: str, window: int | None, kv_bits: int | None, group_size: int, positions: int | None) -> Cache:
    if kind in RECURRENT:
        return StateCache()
    if kind not in (FULL, SLIDING):
        raise ValueError(f"no cache for layer type {kind!r}")
    window = window if kind == SLIDING else None
    return KVCache(window, positions) if kv_bits is None else QuantizedKVCache(kv_bits, group_size, window, positions)


def held_positions(caches: Sequence[Cache]) -> int:
    """Positions every layer's cache holds.

    A forward pass stopped part-way (Ctrl-C) leaves its first layers ahead of the
    rest; each cache's `length` moves only after all its arrays were written, so
    the shortest one counts positions that are complete in every layer."""
    return min((c.length for c in caches), default=0)


def snapshot(caches: Sequence[Cache]) -> list:
    """The state of every layer that cannot be cut back (None for those that can), to resume from later."""
    return [None if c.cuttable else c.snapshot() for c in caches]


def cuttable(caches: Sequence[Cache]) -> bool:
    """Whether every layer can be cut at any position (then no snapshots are needed)."""
    return all(c.cuttable for c in caches)
