"""Turn layers into MLX quantized layers where the checkpoint stores them so.

Bits and group size are read off each tensor's shapes rather than trusted from
a config block, so mixed files (a GGUF with a Q8_0 embedding and Q4_1 layers, or
per-layer recipes) load without a table: a packed uint32 row of an (out, in)
weight holds `in * bits / 32` words, and there is one scale per group. The mode
is read off them too, as mlx-lm's `infer_quant_config` does: uint8 scales and no
biases are one of MLX's float formats, told apart by bits and group size (mxfp4:
4 bits in groups of 32 with a power-of-two scale each, gpt-oss's experts; nvfp4:
4 bits in groups of 16 with an FP8 E4M3 scale; mxfp8: 8 bits in groups of 32),
float scales are affine. Experts (mlx-lm's SwitchLinear, (experts, out, in)) are
quantized the same way per expert.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from ..errors import UnsupportedModelError, WeightMismatchError
from ..untrusted import shown

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
MODES = ("affine", "mxfp4", "nvfp4", "mxfp8")
FLOAT_FORMATS = {(4, 32): "mxfp4", (4, 16): "nvfp4", (8, 32): "mxfp8"}  # (bits, group size) -> mode
# Values dequantized at a time where a whole tensor is made float: MLX's CPU dequantize holds 2x its result at
# 2, 4 and 8 bits, 4x at 3, 6x at 5 and 7x at 6 (measured), so a whole 6-bit embedding would take 7x its floats.
DEQUANTIZE_BLOCK_ELEMENTS = 1 << 21


def widened(
    scales: mx.array, biases: mx.array | None, dtype: mx.Dtype = mx.float32
) -> tuple[mx.array, mx.array | None]:
    """Float scales and biases in `dtype` (16-bit ones held as stored widen exactly); the uint8 exponents of
    mxfp4, nvfp4 and mxfp8 stay as they are."""
    if not mx.issubdtype(scales.dtype, mx.floating):
        return scales, biases
    return scales.astype(dtype), None if biases is None else biases.astype(dtype)


def dequantize_blocks(
    packed: mx.array, scales: mx.array, biases: mx.array | None, group_size: int, bits: int, mode: str = "affine"
) -> mx.array:
    """The float32 values of a quantized matrix, DEQUANTIZE_BLOCK_ELEMENTS at a time: at most twice its floats
    (the blocks, then their join). Float scales and biases are widened first: MLX would dequantize in 16-bit
    ones' width and round every value."""
    scales, biases = widened(scales, biases)
    step = max(1, DEQUANTIZE_BLOCK_ELEMENTS // (packed.shape[-1] * 32 // bits))
    parts = []
    for start in range(0, packed.shape[0], step):
        rows = slice(start, start + step)
        bias = biases[rows] if biases is not None else None
        parts.append(mx.dequantize(packed[rows], scales[rows], bias, group_size, bits, mode=mode, dtype=mx.float32))
        mx.eval(parts[-1])
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)


def dense_weight(module: nn.Module) -> mx.array:
    """A module's weight as float32: dequantized (a block at a time) where it is quantized, whatever its leading
    axes (a linear layer's (out, in), an MoE projection's (experts, out, in))."""
    if "scales" in module:
        args = (module.weight, module.scales, module.get("biases"), module.group_size, module.bits)
        return dequantize_blocks(*args, getattr(module, "mode", "affine"))
    return module.weight.astype(mx.float32)


def unpacked_columns(module: nn.Module) -> int:
    """A module's weight's last axis in values: packed words unpacked where it is quantized."""
    columns = module.weight.shape[-1]
    return columns * 32 // module.bits if "scales" in module else columns


class QuantizedLookup(nn.QuantizedEmbedding):
    """nn.QuantizedEmbedding whose looked-up rows come out in `dtype`, the compute dtype, dequantized at that width.

    Under float32 compute the loader holds 16-bit scales and biases as stored (loader._cast); MLX's lookup would
    dequantize in their 16 bits and round every value, so the gathered rows' scales are widened first. The tied
    head (`as_linear`) needs nothing: quantized_matmul widens them itself, exactly."""

    def __init__(self, *args, dtype: mx.Dtype = mx.float32, **kwargs):
        super().__init__(*args, **kwargs)
        self.dtype = dtype

    def __call__(self, x: mx.array) -> mx.array:
        biases = self.get("biases")
        scales, biases = widened(self["scales"][x], biases[x] if biases is not None else None, self.dtype)
        return mx.dequantize(
            self["weight"][x],
            scales=scales,
            biases=biases,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
            dtype=self.dtype,
        )


def quantize_like(
    model: nn.Module, weights: dict[str, mx.array], mode: str = "affine", dtype: mx.Dtype = mx.float32
) -> int:
    """Quantize every layer that has `<path>.scales` in `weights`; returns how many. Embeddings become
    QuantizedLookup, whose rows come out in `dtype` (the compute dtype).

    `mode`: the config's default; each layer's own mode is read off its tensors (affine and mxfp4 mix)."""
    if mode not in MODES:
        raise UnsupportedModelError(
            f"config.json: quantization mode {shown(mode)} is not supported (only {', '.join(map(repr, MODES))})"
        )
    params: dict[str, dict[str, int | str]] = {}

    def predicate(path: str, module: nn.Module) -> dict[str, int | str] | bool:
        if f"{path}.scales" not in weights or not hasattr(module, "to_quantized"):
            return False
        params[path] = _infer(path, module, weights)
        return dict(params[path])  # nn.quantize may consume the dict

    nn.quantize(model, class_predicate=predicate)
    lookups = [
        (path, QuantizedLookup(m.num_embeddings, m.dims, m.group_size, m.bits, mode=m.mode, dtype=dtype))
        for path, m in model.named_modules()
        if type(m) is nn.QuantizedEmbedding
    ]
    if lookups:  # lazy placeholders, replaced by the file's tensors before anything is evaluated
        model.update_modules(tree_unflatten(lookups))
    return len(params)


def _infer(path: str, module: nn.Module, weights: dict[str, mx.array]) -> dict[str, int | str]:
    """{"bits", "group_size", "mode"} of one layer's stored tensors."""
    packed, scales = weights.get(f"{path}.weight"), weights[f"{path}.scales"]
    # (out, in), or (experts, out, in) for mlx-lm's SwitchLinear: packed and scales keep the leading axes.
    ndim, in_features = module.weight.ndim, module.weight.shape[-1]
    what = "matrix" if ndim == 2 else f"{ndim}-D array"
    if packed is None or packed.dtype != mx.uint32 or packed.ndim != ndim:
        raise WeightMismatchError(f"{path}: has scales but its weight is not a packed uint32 {what}")
    if scales.ndim != ndim or not scales.shape[-1]:
        raise WeightMismatchError(f"{path}.scales: shape {tuple(scales.shape)} is not one scale per group")
    if scales.dtype == mx.uint8:  # 8-bit float scales (E8M0 or E4M3): a float format
        return _float_format(path, packed.shape[-1], scales.shape[-1], in_features, f"{path}.biases" in weights)
    bits, rem = divmod(packed.shape[-1] * 32, in_features)
    if rem or bits not in SUPPORTED_BITS:
        raise WeightMismatchError(
            f"{path}.weight: packed width {packed.shape[-1]} does not fit {in_features} inputs at {SUPPORTED_BITS} bits"
        )
    group, rem = divmod(in_features, scales.shape[-1])
    if rem or group not in (32, 64, 128):
        raise WeightMismatchError(f"{path}.scales: {scales.shape[-1]} groups do not divide {in_features} inputs")
    return {"bits": bits, "group_size": group, "mode": "affine"}


def _float_format(path: str, words: int, groups: int, in_features: int, has_biases: bool) -> dict[str, int | str]:
    """mxfp4, nvfp4 or mxfp8 (FLOAT_FORMATS), told apart by the packed width and the scales; none has biases."""
    if has_biases:
        raise WeightMismatchError(f"{path}: uint8 scales mean a float format (no biases), but {path}.biases is there")
    bits, rem = divmod(words * 32, in_features) if in_features else (0, 1)
    group = in_features // groups if groups and not in_features % groups else 0
    mode = FLOAT_FORMATS.get((bits, group)) if not rem else None
    if mode is None:
        n = in_features
        raise WeightMismatchError(
            f"{path}: uint8 scales mean mxfp4, nvfp4 or mxfp8, whose rows of {n} inputs need {n // 8} packed words "
            f"and {n // 32} scales (mxfp4), {n // 8} and {n // 16} (nvfp4) or {n // 4} and {n // 32} (mxfp8), but the "
            f"file has {words} and {groups}: damaged, or not this model's"
        )
    return {"bits": bits, "group_size": group, "mode": mode}
