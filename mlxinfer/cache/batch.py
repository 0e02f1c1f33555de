"""Several sequences in one cache, so their decode steps run as one batched forward pass.

Rows are right-aligned: all rows write their next token at the same position
`length`, and a row shorter than the longest starts after `left_padding[row]`
unused positions that the attention mask hides. A row joins after its own
prefill (its single-sequence cache is copied in, padded on the left, or the
others are) and leaves when it finishes; padding every remaining row shares is
then cut off, so a batch is never longer than its longest row.

Attention layers line rows up by position (a window's arrays start at `start`,
the same for every row); a recurrent layer's rows are just stacked on axis 0,
each row's state its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from .kv import KVCache, QuantizedKVCache, _capacity
from .layers import Cache, make_cache
from .state import StateCache


def add_row(batch: list[Cache] | None, row: Sequence[Cache]) -> list[Cache]:
    """`batch` (None: a new one) with the single-sequence cache `row` appended as its last row."""
    if batch is None:
        batch = [_empty_like(c) for c in row]
        for layer, single in zip(batch, row):
            _copy_single(layer, single)
        return batch
    for layer, single in zip(batch, row):
        assert layer.left_padding is not None
        length = max(layer.length, single.length)
        shift = length - layer.length
        padding = [pad + shift for pad in layer.left_padding] + [length - single.length]
        if isinstance(layer, StateCache):
            layer.set_rows(_stacked(layer.slots, single.slots), length, padding)
            continue
        start = length - max(layer.length - layer.start, single.length - single.start)
        old = [_right_aligned(a, layer.length - layer.start, length - start) for a in layer.arrays]
        new = [_right_aligned(a, single.length - single.start, length - start) for a in single.arrays]
        layer.set_rows([mx.concatenate(pair, axis=0) for pair in zip(old, new)], length, padding, start)
    return batch


def drop_rows(batch: list[Cache], rows: Sequence[int]) -> list[Cache] | None:
    """`batch` without `rows` (None once empty), less the padding every remaining row has."""
    gone = set(rows)
    keep = [i for i in range(len(batch[0].left_padding or [])) if i not in gone]
    if not keep:
        return None
    index = mx.array(keep)
    for layer in batch:
        padding = [layer.left_padding[i] for i in keep]
        cut = min(padding)
        padding = [pad - cut for pad in padding]
        if isinstance(layer, StateCache):
            layer.set_rows([_take(s, index) for s in layer.slots], layer.length - cut, padding)
            continue
        first = max(0, cut - layer.start)  # positions before `cut` are padding in every row left
        arrays = [mx.take(a[..., first : layer.length - layer.start, :], index, axis=0) for a in layer.arrays]
        layer.set_rows(arrays, layer.length - cut, padding, max(0, layer.start - cut))
    return batch


def row_cache(batch: Sequence[Cache], row: int, kinds, kv_bits: int | None, group_size: int = 64) -> list[Cache]:
    """Row `row` of `batch` as a single-sequence cache (for the prefix cache), without its padding."""
    single = make_cache(kinds, kv_bits, group_size)
    for cache, layer in zip(single, batch):
        pad = layer.left_padding[row]
        if isinstance(layer, StateCache):
            cache.load_state(tuple(_take(s, mx.array([row])) for s in layer.slots), layer.length - pad)
            continue
        first = max(pad, layer.start)
        state = tuple(a[row : row + 1, :, first - layer.start : layer.length - layer.start, :] for a in layer.arrays)
        cache.load_state(state, layer.length - pad)
    return single


def _copy_single(layer: Cache, single: Cache) -> None:
    if isinstance(single, StateCache):
        layer.set_rows(single.slots, single.length, [0])
        return
    held = single.length - single.start
    arrays = [_right_aligned(a, held, held) for a in single.arrays]
    layer.set_rows(arrays, single.length, [0], single.start)


def _empty_like(cache: Cache) -> Cache:
    if isinstance(cache, StateCache):
        return StateCache()
    if isinstance(cache, QuantizedKVCache):
        return QuantizedKVCache(cache.bits, cache.group_size, cache.window)
    return KVCache(cache.window)


def _stacked(olds: list[mx.array | None], news: list[mx.array | None]) -> list[mx.array | None]:
    return [None if o is None or n is None else mx.concatenate([o, n], axis=0) for o, n in zip(olds, news)]


def _take(slot: mx.array | None, index: mx.array) -> mx.array | None:
    return None if slot is None else mx.take(slot, index, axis=0)


def _right_aligned(array: mx.array, used: int, length: int) -> mx.array:
    """The first `used` positions of `array`, moved to end at `length`, with room to grow after."""
    rows, heads, _, width = array.shape
    before = mx.zeros((rows, heads, length - used, width), array.dtype)
    after = mx.zeros((rows, heads, _capacity(length + 1) - length, width), array.dtype)
    return mx.concatenate([before, array[..., :used, :], after], axis=2)
