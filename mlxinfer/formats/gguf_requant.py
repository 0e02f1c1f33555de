"""GGUF types no MLX group can hold as they are -> the MLX affine type that measured closest, rounded once.

Q2_K, Q3_K and Q6_K scale sub-blocks of 16 values, and the IQ and TQ types use lattice or ternary codebooks;
MLX's affine groups are 32, 64 or 128 values with one scale and bias each. These tensors are dequantized by the
`gguf` package (a slice of rows at a time: gguf_kquants.by_rows) and rounded to nearest onto the type below.
Of the MLX affine types that hold at most 1.1x the source's bits per weight (codes plus a 16-bit scale and bias
per group), it is the one that adds the least error to the source's own values. bench/gguf_requant_bench.py
measured the choice (its table is in bench/README.md): the relative RMS error added, on the Gemma 3 270M Q4_K_M
file's real Q6_K tensors and on random blocks of every other type. Below 2 bits per weight (IQ1_S, IQ1_M, TQ1_0)
nothing fits: 2-bit group 128, the smallest MLX type, is used.
"""

from __future__ import annotations

import numpy as np

from .gguf_kquants import by_rows, pack_bits

# ggml's type ids (ggml.h) -> (MLX bits, group size)
Q2_K, Q3_K, Q6_K = 10, 11, 14
IQ2_XXS, IQ2_XS, IQ3_XXS, IQ1_S, IQ4_NL, IQ3_S, IQ2_S, IQ4_XS, IQ1_M, TQ1_0, TQ2_0 = (
    16, 17, 18, 19, 20, 21, 22, 23, 29, 34, 35
)  # fmt: skip
REQUANTIZED: dict[int, tuple[int, int]] = {
    Q6_K: (6, 32), Q3_K: (3, 64), Q2_K: (2, 64),
    IQ4_XS: (4, 64), IQ4_NL: (4, 64), IQ3_S: (3, 64), IQ3_XXS: (3, 128),
    IQ2_S: (2, 64), IQ2_XS: (2, 64), IQ2_XXS: (2, 128),
    IQ1_M: (2, 128), IQ1_S: (2, 128), TQ1_0: (2, 128), TQ2_0: (2, 128),
}  # fmt: skip


def requantize(
    raw: np.ndarray, rows: int, cols: int, ggml_type: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """(packed uint32 (rows, cols*bits/32), scales and biases float32 (rows, cols/group), bits, group) of the
    tensor whose blocks are `raw`, rounded to nearest on REQUANTIZED[ggml_type]."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    bits, group = REQUANTIZED[ggml_type]
    while cols % group:  # IQ4_NL's blocks are 32 values: llama.cpp picks it for rows K-quants cannot split
        group //= 2
    kind = GGMLQuantizationType(ggml_type)
    by_row = raw.reshape(rows, -1)

    def rows_of(part: slice) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        values = dequantize(by_row[part], kind).reshape(-1, cols).astype(np.float32, copy=False)
        return round_affine(values, bits, group)

    packed, scales, biases = by_rows(rows, cols, rows_of)
    return packed, scales, biases, bits, group


def round_affine(values: np.ndarray, bits: int, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Min-max round to nearest: w ~ scale * q + bias with q in [0, 2**bits - 1] per group of `group` values."""
    rows, cols = values.shape
    groups = values.reshape(rows, cols // group, group)
    low, high = groups.min(axis=-1), groups.max(axis=-1)
    scale = (high - low) / ((1 << bits) - 1)
    scale = np.where(scale > 0, scale, np.float32(1))  # a constant group: every code 0, the bias is its value
    q = np.rint((groups - low[..., None]) / scale[..., None])
    q = np.clip(q, 0, (1 << bits) - 1).astype(np.uint8).reshape(rows, cols)
    return pack_bits(q, bits), scale.astype(np.float32), low.astype(np.float32)
