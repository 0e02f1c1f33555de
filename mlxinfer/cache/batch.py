"""Several sequences in one cache, so their decode steps run as one batched forward pass.

Rows are right-aligned: all rows write their next token at the same position
`length`, and a row shorter than the longest starts after `left_padding[row]`
unused positions that the attention mask hides. A row joins after its own
prefill (its single-sequence cache is copied in, padded on the left, or the
others are) and leaves when it finishes; padding every remaining row shares is
then cut off, so a batch is never longer than its longest row.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from .kv import Cache, KVCache, QuantizedKVCache, _capacity, make_cache


def add_row(batch: list[Cache] | None, row: Sequence[Cache]) -> list[Cache]:
    """`batch` (None: a new one) with the single-sequence cache `row` appended as its last row."""
    if batch is None:
        batch = [_empty_like(c) for c in row]
        for layer, single in zip(batch, row):
            arrays = [_right_aligned(a, single.length, single.length) for a in single.arrays]
            layer.set_rows(arrays, single.length, [0])
        return batch
    for layer, single in zip(batch, row):
        assert layer.left_padding is not None
        length = max(layer.length, single.length)
        old = [_right_aligned(a, layer.length, length) for a in layer.arrays]
        new = [_right_aligned(a, single.length, length) for a in single.arrays]
        shift = length - layer.length
        padding = [pad + shift for pad in layer.left_padding] + [length - single.length]
        layer.set_rows([mx.concatenate(pair, axis=0) for pair in zip(old, new)], length, padding)
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
        arrays = [mx.take(a[..., cut : layer.length, :], index, axis=0) for a in layer.arrays]
        layer.set_rows(arrays, layer.length - cut, [pad - cut for pad in padding])
    return batch


def row_cache(batch: Sequence[Cache], row: int, kv_bits: int | None, group_size: int = 64) -> list[Cache]:
    """Row `row` of `batch` as a single-sequence cache (for the prefix cache), without its padding."""
    single = make_cache(len(batch), kv_bits, group_size)
    for cache, layer in zip(single, batch):
        pad = layer.left_padding[row]
        cache.load_state(tuple(a[row : row + 1, :, pad : layer.length, :] for a in layer.arrays))
    return single


def _empty_like(cache: Cache) -> Cache:
    return QuantizedKVCache(cache.bits, cache.group_size) if isinstance(cache, QuantizedKVCache) else KVCache()


def _right_aligned(array: mx.array, used: int, length: int) -> mx.array:
    """The first `used` positions of `array`, moved to end at `length`, with room to grow after."""
    rows, heads, _, width = array.shape
    before = mx.zeros((rows, heads, length - used, width), array.dtype)
    after = mx.zeros((rows, heads, _capacity(length + 1) - length, width), array.dtype)
    return mx.concatenate([before, array[..., :used, :], after], axis=2)
