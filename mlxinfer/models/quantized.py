"""Turn layers into MLX quantized layers where the checkpoint stores them so.

Bits and group size are read off each tensor's shapes rather than trusted from
a config block, so mixed files (a GGUF with a Q8_0 embedding and Q4_1 layers, or
per-layer recipes) load without a table: a packed uint32 row of an (out, in)
weight holds `in * bits / 32` words, and there is one scale per group. Experts
(mlx-lm's SwitchLinear, (experts, out, in)) are quantized the same way per expert.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..errors import UnsupportedModelError, WeightMismatchError
from ..untrusted import shown

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)


def quantize_like(model: nn.Module, weights: dict[str, mx.array], mode: str = "affine") -> int:
    """Quantize every layer that has `<path>.scales` in `weights`; returns how many."""
    if mode != "affine":
        raise UnsupportedModelError(f"config.json: quantization mode {shown(mode)} is not supported (only 'affine')")
    params: dict[str, tuple[int, int]] = {}

    def predicate(path: str, module: nn.Module) -> dict[str, int] | bool:
        if f"{path}.scales" not in weights or not hasattr(module, "to_quantized"):
            return False
        bits, group = _infer(path, module, weights)
        params[path] = (bits, group)
        return {"bits": bits, "group_size": group}

    nn.quantize(model, class_predicate=predicate)
    return len(params)


def _infer(path: str, module: nn.Module, weights: dict[str, mx.array]) -> tuple[int, int]:
    packed, scales = weights.get(f"{path}.weight"), weights[f"{path}.scales"]
    # (out, in), or (experts, out, in) for mlx-lm's SwitchLinear: packed and scales keep the leading axes.
    ndim, in_features = module.weight.ndim, module.weight.shape[-1]
    what = "matrix" if ndim == 2 else f"{ndim}-D array"
    if packed is None or packed.dtype != mx.uint32 or packed.ndim != ndim:
        raise WeightMismatchError(f"{path}: has scales but its weight is not a packed uint32 {what}")
    if scales.ndim != ndim or not scales.shape[-1]:
        raise WeightMismatchError(f"{path}.scales: shape {tuple(scales.shape)} is not one scale per group")
    bits, rem = divmod(packed.shape[-1] * 32, in_features)
    if rem or bits not in SUPPORTED_BITS:
        raise WeightMismatchError(
            f"{path}.weight: packed width {packed.shape[-1]} does not fit {in_features} inputs at {SUPPORTED_BITS} bits"
        )
    group, rem = divmod(in_features, scales.shape[-1])
    if rem or group not in (32, 64, 128):
        raise WeightMismatchError(f"{path}.scales: {scales.shape[-1]} groups do not divide {in_features} inputs")
    return bits, group
