"""Group-wise affine quantization in MLX's own format (`mx.quantize`).

w ≈ scale * q + bias per group of `group_size` consecutive inputs, q in [0, 2^bits).
Large tensors are quantized in row blocks so temporaries stay small.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import mlx.core as mx

from mlxinfer.models.quantized import dequantize_blocks

ROW_BLOCK_ELEMENTS = 1 << 24  # 64 MiB of float32 per block


def quantize_rows(
    weight: mx.array, bits: int, group_size: int, dtype: mx.Dtype, mode: str = "affine"
) -> tuple[mx.array, mx.array, mx.array | None]:
    """(packed uint32 weight, scales, biases) of a weight, scales/biases in `dtype`; in a float `mode` (mxfp4,
    nvfp4, mxfp8) the scales are 8-bit floats, kept as MLX stores them (uint8), and there are no biases.

    Groups run along the last axis; a 3-D weight (experts, out, in), as mlx-lm's SwitchLinear holds it,
    is quantized per expert exactly as `mx.quantize` would quantize it whole."""
    flat = weight.reshape(-1, weight.shape[-1])  # (experts * out, in): the same groups, row blocks stay bounded
    return quantize_blocks(weight.shape, lambda start, stop: flat[start:stop], bits, group_size, dtype, mode)


def quantize_blocks(
    shape: tuple[int, ...],
    rows: Callable[[int, int], mx.array],
    bits: int,
    group_size: int,
    dtype: mx.Dtype,
    mode: str = "affine",
    block_elements: int = ROW_BLOCK_ELEMENTS,
) -> tuple[mx.array, mx.array, mx.array | None]:
    """quantize_rows of the tensor of `shape` whose rows [start, stop), flattened to 2-D, `rows(start, stop)`
    gives, about `block_elements` values at a time: no more of it is ever held as floats."""
    lead, columns = shape[:-1], shape[-1]
    step = max(1, block_elements // max(1, columns))
    parts = []
    for start in range(0, math.prod(lead), step):
        block = rows(start, start + step).astype(mx.float32)
        packed, scales, *biases = mx.quantize(block, group_size=group_size, bits=bits, mode=mode)
        if mode == "affine":
            parts.append((packed, scales.astype(dtype), biases[0].astype(dtype)))
        else:
            parts.append((packed, scales))
        mx.eval(parts[-1])
    count = len(parts[0])
    joined = parts[0] if len(parts) == 1 else tuple(mx.concatenate([p[i] for p in parts], axis=0) for i in range(count))
    shaped = tuple(a.reshape(*lead, a.shape[-1]) for a in joined)
    return shaped if count == 3 else (*shaped, None)  # type: ignore[return-value]


def dequantize_rows(packed: mx.array, scales: mx.array, biases: mx.array, bits: int, group_size: int) -> mx.array:
    """The float32 values a quantized triplet stands for (models/quantized.dequantize_blocks: scales widened first,
    a block of rows at a time)."""
    return dequantize_blocks(packed, scales, biases, group_size, bits)


def bits_per_weight(bits: int, group_size: int, scale_bytes: int = 2) -> float:
    """Storage cost of one weight, scales and biases included."""
    return bits + 2 * scale_bytes * 8 / group_size
