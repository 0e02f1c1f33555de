"""LoRA on multi-head latent attention's kv_b_proj (DeepSeek V2/V3 and their kin), per row.

transformers' kv_b_proj maps the compressed KV (C features) to every head's no-RoPE key and value (H x (qk + v)).
mlx-lm's attention, which the deepseek family runs, splits it into two per-head matrices and folds them into the
query and the output (`embed_q`, (H, C, qk); `unembed_out`, (H, v, C)), so the cache holds the latent alone. A
pair (a: (C, r), b: (r, H x (qk + v))) on kv_b_proj becomes, per head, one shared `a` and an up-projection per
half: keys (H, r, qk) beside embed_q, values (H, r, v) beside unembed_out, each applied where its matrix is.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..models.quantized import unpacked_columns
from .reading import LowRank
from .rows import BASE, Selection, with_row_padded

KEYS, VALUES = "embed_q", "unembed_out"  # mlx-lm's halves of kv_b_proj
SPLIT = "kv_b_proj"


class LatentRows(nn.Module):
    """embed_q or unembed_out (mlx-lm's MultiLinear), plus each row's adapter's share of a kv_b_proj pair."""

    def __init__(self, base: nn.Module, role: str, selection: Selection, dtype: mx.Dtype):
        super().__init__()
        heads, width = latent_dims(base, role)
        latent = base.weight.shape[1] if role == KEYS else unpacked_columns(base)
        self.base, self.role, self._selection = base, role, selection
        self.a = mx.zeros((1, latent, 1), dtype)  # (slots, C, r): slot 0 the base's zeros
        self.up = mx.zeros((1, heads, 1, width), dtype)  # (slots, H, r, qk or v)

    def __call__(self, x: mx.array, transpose: bool = True) -> mx.array:
        y = self.base(x, transpose=transpose)
        selection = self._selection
        if selection.uniform == BASE:
            return y
        if selection.uniform is not None:
            a, up = self.a[selection.uniform], self.up[selection.uniform]
        else:  # rows lead x: (rows, heads or 1, positions, features)
            a, up = self.a[selection.slots][:, None], self.up[selection.slots]
        if self.role == KEYS and transpose:  # the query folded in: x (.., qk) -> (.., C)
            z = (x @ up.swapaxes(-1, -2)) @ a.swapaxes(-1, -2)
        else:  # the latent to keys, or to values: x (.., C) -> (.., qk or v)
            z = (x @ a) @ up
        return y + z.astype(y.dtype)

    def staged(self, slot: int, slots: int, pair: LowRank | None, dtype: mx.Dtype) -> dict[str, mx.array]:
        """New stacks with this half of `pair` (a kv_b_proj pair; None: nothing) in `slot`, room for `slots`."""
        slots = max(self.a.shape[0], slots)
        a = up = None
        if pair is not None:
            heads, width = self.up.shape[1], self.up.shape[3]
            per_head = pair.b.reshape(pair.rank, heads, -1)  # (r, H, qk + v)
            half = per_head[..., :width] if self.role == KEYS else per_head[..., -width:]
            a, up = pair.a.astype(dtype), half.transpose(1, 0, 2).astype(dtype)  # (H, r, qk or v)
        out = {"a": with_row_padded(self.a, slot, slots, 2, a), "up": with_row_padded(self.up, slot, slots, 2, up)}
        mx.eval(out)
        return out


def latent_dims(module: nn.Module, role: str) -> tuple[int, int]:
    """(heads, width) of one half: qk for embed_q ((H, C, qk)), v for unembed_out ((H, v, C))."""
    return module.weight.shape[0], unpacked_columns(module) if role == KEYS else module.weight.shape[1]


def split_dims(attention: nn.Module | None) -> tuple[int, int] | None:
    """(C, H x (qk + v)): the (in, out) kv_b_proj would have in `attention`, or None if it holds no split halves."""
    keys, values = (getattr(getattr(attention, n, None), "base", getattr(attention, n, None)) for n in (KEYS, VALUES))
    if keys is None or values is None:
        return None
    heads, qk = latent_dims(keys, KEYS)
    return keys.weight.shape[1], heads * (qk + latent_dims(values, VALUES)[1])
