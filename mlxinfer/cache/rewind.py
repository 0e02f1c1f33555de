"""Taking back positions a forward pass wrote: speculative decoding's rejected drafts.

A verification pass writes every drafted position into the cache; the ones
rejected must go. Attention layers (full or windowed, quantized or not) just
forget their last positions: a window's write keeps the `window - 1` positions
before it, so cutting back to any point after the pass began leaves every key a
later query sees. A recurrent state cannot be cut back: `mark` keeps the state
before the pass (MLX arrays are never written in place, so keeping them is free)
and `rewind` restores it; the caller then feeds the kept positions again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .layers import Cache
from .state import StateCache


@dataclass(frozen=True)
class Mark:
    """Where a cache stood before a forward pass: its length, and each recurrent layer's state then."""

    length: int
    states: tuple[tuple | None, ...]


def mark(caches: Sequence[Cache]) -> Mark:
    """The caches' position now (cheap: recurrent slot arrays are kept by reference)."""
    states = tuple(tuple(c.slots) if isinstance(c, StateCache) else None for c in caches)
    return Mark(caches[0].length, states)


def rewind(caches: Sequence[Cache], at: Mark, length: int) -> int:
    """Cut `caches` back to hold `length` positions (at.length <= length <= now).

    A pass writes at most the window's storage, keeping the `window - 1` positions before it,
    so rewinding within one pass always works; ValueError (nothing changed) if several
    passes since the mark let a window drop what the rewind needs.

    Returns the position they hold afterwards: `length` when every layer could be
    cut, else `at.length` (recurrent states restored to the mark), in which case the
    positions from there to `length` must be fed again."""
    if not at.length <= length <= caches[0].length:
        raise ValueError(f"cannot rewind to {length} positions: the pass ran from {at.length} to {caches[0].length}")
    if length == caches[0].length:
        return length  # every position was kept
    recurrent = any(state is not None for state in at.states)
    target = at.length if recurrent else length
    if any(state is None and cache.start > _first_needed(cache, target) for cache, state in zip(caches, at.states)):
        # Only after several passes (a draft model's): a window regrew and let go of positions still needed.
        raise ValueError(f"a sliding window no longer holds what follows position {target}; start the cache afresh")
    for cache, state in zip(caches, at.states):
        if state is not None:
            cache.set_rows(list(state), target, cache.left_padding)
        else:
            cache.trim(cache.length - target)
    return target


def _first_needed(cache: Cache, length: int) -> int:
    """The first position the next query sees once `cache` holds `length` positions."""
    return 0 if cache.window is None else max(0, length - (cache.window - 1))
