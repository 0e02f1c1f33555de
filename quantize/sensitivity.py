"""Spend bits where they hurt most: per-layer quantization error on calibration text.

For every linear layer (and the embedding when it doubles as the output head) we
record its inputs X on calibration tokens and measure the relative output error
||X (W - Q_b(W))^T||^2 / ||X W^T||^2 at 4 and 8 bits. Layers are then moved from
4 to 8 bits in order of error removed per extra bit, until the bits-per-weight
budget is spent.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from .affine import bits_per_weight, dequantize_rows, quantize_rows


@dataclass(frozen=True)
class LayerError:
    path: str
    params: int
    err4: float
    err8: float


class _Capture(nn.Module):
    """Wraps a Linear and keeps what it was called with."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.inputs: list[mx.array] = []

    def __call__(self, x: mx.array) -> mx.array:
        self.inputs.append(x.reshape(-1, x.shape[-1]))
        return self.inner(x)


def layer_errors(model: nn.Module, ids: list[int], group_size: int, tied_head: bool) -> list[LayerError]:
    """Relative output error of each linear layer at 4 and 8 bits, on `ids`."""
    # The output head sees the final hidden states; capture every other linear layer.
    linears = [(p, m) for p, m in model.named_modules() if isinstance(m, nn.Linear) and p != "lm_head"]
    captures = [(p, _Capture(m)) for p, m in linears]
    model.update_modules(tree_unflatten(captures))
    try:
        hidden = model.hidden(mx.array(ids)[None])
        mx.eval(hidden)
    finally:
        model.update_modules(tree_unflatten(linears))
    inputs = {p: mx.concatenate(c.inputs, axis=0) for p, c in captures}
    inputs["model.embed_tokens" if tied_head else "lm_head"] = hidden.reshape(-1, hidden.shape[-1])
    params = dict(tree_flatten(model.parameters()))
    return [_error(path, params[f"{path}.weight"], x, group_size) for path, x in inputs.items()]


def _error(path: str, weight: mx.array, x: mx.array, group_size: int) -> LayerError:
    weight = weight.astype(mx.float32)
    x = x.astype(mx.float32)
    reference = x @ weight.T
    norm = mx.sum(reference * reference).item() or 1.0
    errors = []
    for bits in (4, 8):
        approx = dequantize_rows(*quantize_rows(weight, bits, group_size, mx.float32), bits, group_size)
        diff = x @ (weight - approx).T
        errors.append(mx.sum(diff * diff).item() / norm)
    return LayerError(path, weight.size, errors[0], errors[1])


def allocate(
    errors: list[LayerError], bpw: float, group_size: int, fixed_params: int = 0, fixed_bits: float = 0.0
) -> dict[str, int]:
    """Bits per layer (4 or 8) whose average, over all weights, stays within `bpw`.

    `fixed_params` weights whose format is already decided (norms in 16 bits, layers not
    measured) cost `fixed_bits` in all.
    """
    low, high = bits_per_weight(4, group_size), bits_per_weight(8, group_size)
    measured = sum(e.params for e in errors)
    budget = bpw * (measured + fixed_params) - fixed_bits - low * measured
    table = {e.path: 4 for e in errors}
    # Greatest error removed per extra bit first.
    for e in sorted(errors, key=lambda e: (e.err4 - e.err8) / e.params, reverse=True):
        cost = (high - low) * e.params
        if cost <= budget:
            table[e.path] = 8
            budget -= cost
    return table
