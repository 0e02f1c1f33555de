"""Per-expert LoRA (mlx-lm's LoRASwitchLinear: a pair per expert of an MoE layer's projections), per row.

An MoE layer routes each token to k of its E experts (mlx-lm's SwitchGLU, which every MoE family here uses). An
adapter's pair for expert e of a projection is applied where the base applies expert e, so each (token, expert)
needs its row's slot and its expert: the stacks hold slots x E pairs, and index slot * E + expert picks one.
SwitchGLU sorts the (token, expert) pairs by expert once they are 64 or more; the slots are carried through the
same order, which is why the whole layer is wrapped rather than its projections.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from ..models.quantized import unpacked_columns
from .reading import LowRank
from .rows import BASE, Selection, with_row_padded

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class ExpertRows(nn.Module):
    """mlx-lm's SwitchGLU, plus each row's adapter's per-expert pairs for its projections."""

    def __init__(self, base: nn.Module, selection: Selection, dtype: mx.Dtype):
        super().__init__()
        self.base, self._selection = base, selection
        self.experts = base.gate_proj.weight.shape[0]
        # per projection: a (slots * experts, in, rank) and b (slots * experts, rank, out), slot 0 all zeros
        self.pairs = {name: _empty(base, name, self.experts, dtype) for name in PROJECTIONS}

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        selection = self._selection
        if selection.uniform == BASE:
            return self.base(x, indices)
        # The row's slot of each (token, expert): rows are the leading axis of `indices`, (rows, positions, k).
        slot = selection.uniform if selection.uniform is not None else selection.slots.reshape(-1, 1, 1)
        picked = (slot * self.experts + indices).astype(indices.dtype)  # the router's index type, on every backend
        x = mx.expand_dims(x, (-2, -3))
        indices = mx.stop_gradient(indices)
        ordered = indices.size >= 64  # as SwitchGLU: many pairs run sorted by expert
        order = inverse = None
        idx, lora_idx = indices, picked
        if ordered:
            width = indices.shape[-1]
            order = mx.argsort(indices.flatten())
            inverse = mx.argsort(order)
            x, idx, lora_idx = x.flatten(0, -3)[order // width], indices.flatten()[order], picked.flatten()[order]
        up = self._project("up_proj", x, idx, lora_idx, ordered)
        gate = self._project("gate_proj", x, idx, lora_idx, ordered)
        out = self._project("down_proj", self.base.activation(up, gate), idx, lora_idx, ordered)
        if ordered:
            out = mx.unflatten(out[inverse], 0, indices.shape)
        return out.squeeze(-2)

    def _project(self, name: str, x: mx.array, idx: mx.array, lora_idx: mx.array, ordered: bool) -> mx.array:
        y = getattr(self.base, name)(x, idx, sorted_indices=ordered)
        pair = self.pairs[name]
        z = mx.gather_mm(mx.gather_mm(x, pair["a"], rhs_indices=lora_idx), pair["b"], rhs_indices=lora_idx)
        return y + z.astype(y.dtype)

    def staged(self, slot: int, slots: int, pairs: dict[str, LowRank], dtype: mx.Dtype,
               weight: Callable[[], mx.array] | None = None) -> dict[str, dict]:  # fmt: skip
        """New stacks with each projection's pair in `pairs` (the others nothing) in `slot`, room for `slots`."""
        experts, out = self.experts, {}
        for name, stacks in self.pairs.items():
            pair = pairs.get(name)
            a, b = (s.reshape(-1, experts, *s.shape[1:]) for s in (stacks["a"], stacks["b"]))  # (slots, E, ., .)
            rows_a = pair.a.astype(dtype) if pair is not None else None
            rows_b = pair.b.astype(dtype) if pair is not None else None
            a = with_row_padded(a, slot, slots, 3, rows_a)
            b = with_row_padded(b, slot, slots, 2, rows_b)
            out[name] = {"a": a.reshape(-1, *a.shape[2:]), "b": b.reshape(-1, *b.shape[2:])}
        mx.eval(out)
        return {"pairs": out}


def expert_dims(glu: nn.Module, name: str) -> tuple[int, int]:
    """(out, in) of one expert of projection `name`, quantized or not."""
    module = getattr(glu, name)
    return module.weight.shape[1], unpacked_columns(module)


def _empty(glu: nn.Module, name: str, experts: int, dtype: mx.Dtype) -> dict[str, mx.array]:
    out_dims, in_dims = expert_dims(glu, name)
    return {"a": mx.zeros((experts, in_dims, 1), dtype), "b": mx.zeros((experts, 1, out_dims), dtype)}
