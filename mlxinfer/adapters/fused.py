"""The one home of what an adapter does to a weight: W + (a @ b)^T for LoRA, then DoRA's per-row rescaling.

Used three ways: DoRA's factor for per-row application (rows.py), the merged weights `mlxinfer convert --adapter`
quantizes (better than quantizing first), and a loaded model fused in place (`fuse_into`: the float model the
converter calibrates on and compares with).
"""

from __future__ import annotations

import importlib

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from ..errors import AdapterError
from ..models.quantized import dense_weight
from .reading import Adapter, LowRank


def adapted(weight: mx.array, pair: LowRank) -> mx.array:
    """`weight` (out, in), or per expert (experts, out, in), plus the pair's update, in float32, before DoRA's
    rescaling."""
    return weight.astype(mx.float32) + (pair.a.astype(mx.float32) @ pair.b.astype(mx.float32)).swapaxes(-1, -2)


def dora_factor(weight: mx.array, pair: LowRank) -> mx.array:
    """DoRA's rescaling of each output row, m / ||W + BA|| (float32, (out,)); the row norms run over the inputs,
    as mlx-lm's DoRALinear and PEFT's `get_weight_norm` take them."""
    assert pair.magnitude is not None
    return pair.magnitude.astype(mx.float32) / mx.linalg.norm(adapted(weight, pair), axis=1)


def fused(weight: mx.array, pair: LowRank) -> mx.array:
    """The merged weight (out, in), float32: what running the base with this pair computes, as one matrix."""
    merged = adapted(weight, pair)
    return merged if pair.magnitude is None else merged * dora_factor(weight, pair)[:, None]


def fuse_into(model: nn.Module, adapter: Adapter, dtype: mx.Dtype) -> None:
    """Merge `adapter` (named as `model`'s modules are) into `model`'s weights, in place: each adapted layer becomes
    a float `dtype` nn.Linear holding the merged weight, each module it saves whole takes its tensors."""
    modules = dict(model.named_modules())
    merged = []
    for path, pair in adapter.modules.items():
        module = modules.get(path)
        kinds = ("SwitchLinear", "QuantizedSwitchLinear") if pair.per_expert else ("Linear", "QuantizedLinear")
        if type(module).__name__ not in kinds:  # mlx-lm's switch layers, named: importing mlx-lm costs 200 MB
            raise AdapterError(f"{adapter.path}: adapts {path}, which this model has no such layer for")
        base = dense_weight(module)
        if base.shape != (*pair.a.shape[:-2], pair.b.shape[-1], pair.a.shape[-2]):
            raise AdapterError(f"{adapter.path}: {path} does not fit this model's layer {tuple(base.shape)}")
        weight = fused(base, pair).astype(dtype)
        *experts, rows, columns = weight.shape
        bias = "bias" in module
        layer = (
            _switch_linear(module)(columns, rows, experts[0], bias=bias)
            if experts
            else nn.Linear(columns, rows, bias=bias)
        )
        layer.update({"weight": weight, **({"bias": module.bias} if bias else {})})
        merged.append((path, layer))
    model.update_modules(tree_unflatten(merged))
    model.update(tree_unflatten([(k, v.astype(dtype)) for k, v in adapter.replaced.items()]))
    mx.eval(model.parameters())


def _switch_linear(module: nn.Module) -> type:
    """mlx-lm's SwitchLinear, from the module `module`'s class came from (imported already: the model holds it)."""
    return importlib.import_module(type(module).__module__).SwitchLinear
