"""Group-wise affine quantization in MLX's own format (`mx.quantize`).

w ≈ scale * q + bias per group of `group_size` consecutive inputs, q in [0, 2^bits).
Large tensors are quantized in row blocks so temporaries stay small.
"""

from __future__ import annotations

import mlx.core as mx

ROW_BLOCK_ELEMENTS = 1 << 24  # 64 MiB of float32 per block


def quantize_rows(weight: mx.array, bits: int, group_size: int, dtype: mx.Dtype) -> tuple[mx.array, mx.array, mx.array]:
    """(packed uint32 weight, scales, biases) of a 2-D weight, scales/biases in `dtype`."""
    rows = max(1, ROW_BLOCK_ELEMENTS // max(1, weight.shape[-1]))
    parts = []
    for start in range(0, weight.shape[0], rows):
        block = weight[start : start + rows].astype(mx.float32)
        packed, scales, biases = mx.quantize(block, group_size=group_size, bits=bits)
        parts.append((packed, scales.astype(dtype), biases.astype(dtype)))
        mx.eval(parts[-1])
    if len(parts) == 1:
        return parts[0]
    return tuple(mx.concatenate([p[i] for p in parts], axis=0) for i in range(3))  # type: ignore[return-value]


def dequantize_rows(packed: mx.array, scales: mx.array, biases: mx.array, bits: int, group_size: int) -> mx.array:
    """The float32 values a quantized triplet stands for."""
    return mx.dequantize(packed, scales.astype(mx.float32), biases.astype(mx.float32), group_size=group_size, bits=bits)


def bits_per_weight(bits: int, group_size: int, scale_bytes: int = 2) -> float:
    """Storage cost of one weight, scales and biases included."""
    return bits + 2 * scale_bytes * 8 / group_size
