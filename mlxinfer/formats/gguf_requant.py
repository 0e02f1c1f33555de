"""GGUF types no MLX group can hold as they are -> the MLX affine type that measured closest, rounded once.

Q2_K, Q3_K and Q6_K scale sub-blocks of 16 values, and the IQ and TQ types use lattice or ternary codebooks;
MLX's affine groups are 32, 64 or 128 values with one scale and bias each. These tensors are dequantized by the
`gguf` package (a slice of rows at a time: gguf_kquants.by_rows) and rounded onto the type below, on the grid
per group that fits its values best (round_affine).
Of the MLX affine types that hold at most 1.1x the source's bits per weight (codes plus a 16-bit scale and bias
per group), it is the one that adds the least error to the source's own values; the IQ1 and IQ2 types are held at
3 bits instead (USABLE_BITS), the IQ4 types in groups of 32 (BLOCK_ALIGNED), and TQ1_0, below any MLX type's size,
at 2 bits (exact). bench/gguf_requant_bench.py measured the choice (its tables are in bench/README.md): the
relative RMS error added, on llama.cpp's own Gemma 3 270M files of every type, and each file's perplexity and KL
on held-out text against its own dequantized values.
"""

from __future__ import annotations

import numpy as np

from .gguf_kquants import by_rows, pack_bits

# ggml's type ids (ggml.h) -> (MLX bits, group size)
Q2_K, Q3_K, Q6_K = 10, 11, 14
IQ2_XXS, IQ2_XS, IQ3_XXS, IQ1_S, IQ4_NL, IQ3_S, IQ2_S, IQ4_XS, IQ1_M, TQ1_0, TQ2_0 = (
    16, 17, 18, 19, 20, 21, 22, 23, 29, 34, 35
)  # fmt: skip
# The IQ1 and IQ2 types' lattice codebooks hold far more than an MLX 2-bit group: rounded onto one, llama.cpp's
# Gemma 3 270M IQ2_XXS file's perplexity on held-out text rose +8,455% over its own values (nonsense); on 3-bit
# groups of 64, +69% (4-bit: +38%). So they are held at 3 bits, 1.5-2.2x their bytes, where the 1.1x bound would
# give 2 (bench/README.md). Q2_K, a K-quant, keeps the bound; TQ1_0 / TQ2_0 are exact at 2 bits.
USABLE_BITS = 3
# IQ4_NL's blocks and IQ4_XS's sub-blocks are 32 values with one scale each: in MLX groups of 32, one group a block,
# llama.cpp's Gemma 3 270M IQ4_NL file measured +8.3% perplexity over its own values on held-out text, against +27.5%
# in groups of 64 (1.11x and 1.18x the source's bits, past the K-quants' 1.1x).
REQUANTIZED: dict[int, tuple[int, int]] = {
    Q6_K: (6, 32), Q3_K: (3, 64), Q2_K: (2, 64),
    IQ4_XS: (4, 32), IQ4_NL: (4, 32), IQ3_S: (3, 64), IQ3_XXS: (3, 128),
    IQ2_S: (USABLE_BITS, 64), IQ2_XS: (USABLE_BITS, 64), IQ2_XXS: (USABLE_BITS, 64),
    IQ1_M: (USABLE_BITS, 64), IQ1_S: (USABLE_BITS, 64), TQ1_0: (2, 128), TQ2_0: (2, 128),
}  # fmt: skip
HELD_WIDER = (IQ2_S, IQ2_XS, IQ2_XXS, IQ1_M, IQ1_S)  # past the 1.1x bound, at USABLE_BITS
BLOCK_ALIGNED = (IQ4_NL, IQ4_XS)  # past the 1.1x bound, one MLX group a source block


def requantize(
    raw: np.ndarray, rows: int, cols: int, ggml_type: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """(packed uint32 (rows, cols*bits/32), scales and biases float32 (rows, cols/group), bits, group) of the
    tensor whose blocks are `raw`, rounded to nearest on REQUANTIZED[ggml_type]."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    bits, group = REQUANTIZED[ggml_type]  # each group divides its type's blocks (32 or 256 values), so any row
    kind = GGMLQuantizationType(ggml_type)
    by_row = raw.reshape(rows, -1)

    def rows_of(part: slice) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        values = dequantize(by_row[part], kind).reshape(-1, cols).astype(np.float32, copy=False)
        return round_affine(values, bits, group)

    packed, scales, biases = by_rows(rows, cols, rows_of)
    return packed, scales, biases, bits, group


REFITS = 2  # least-squares refits of each group's grid: a third gained under 1% on the files measured
NARROWED = (1.0, 0.9, 0.8)  # min-max ranges tried, as a share of the group's own range
# From this many bits (Q6_K's 6), plain min-max: the search took Q6_K's added error from 0.019 to 0.0143, little
# beside the 4-bit tensors' ~0.07 in the same files, for several times the time, and Q6_K is in most K-quant files
# (every Q4_K_M's head and half its down projections), so that time is paid at every load of them.
FINE_BITS = 5


def round_affine(values: np.ndarray, bits: int, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w ~ scale * q + bias with q in [0, 2**bits - 1] per group of `group` values: per group, of a few starting
    grids each refitted by least squares, the one with the least squared error (plain min-max from FINE_BITS bits).

    Min-max rounding wastes these types' few levels. Their values sit on the source's own lattice: at 2 bits
    min-max puts no level at zero (a ternary TQ group, mostly zeros, then lost all its signal), and a group's two
    extremes are often lone values. So the starting grids are min-max, min-max narrowed to 0.9 and 0.8 of its range
    about its centre (the extremes clip), and the two grids with zero on a level that just reach the group's
    extremes (n levels below zero, n = floor and ceil of half the levels; {-d, 0, d} is then exact). The refit holds
    the codes and fits the scale and bias to the values, then rounds the codes again; neither step can add error.
    On llama.cpp's own Gemma 3 270M files this cut the perplexity added over the file's own values on held-out text
    by half or more (IQ4_NL +31.8% -> +8.3%, IQ2_XXS +141% -> +69%) and made TQ1_0 / TQ2_0 exact (bench/README.md).
    Picking the best starting grid first and refitting only it took half the time but gave IQ4_NL +12.7%. It takes
    about nine times min-max's time (0.75 s against 0.08 s per 4M values on this project's 2-core CPU)."""
    rows, cols = values.shape
    groups = values.reshape(rows, cols // group, group).astype(np.float32, copy=False)
    top = (1 << bits) - 1
    grids = _starting_grids(groups.min(axis=-1), groups.max(axis=-1), top)
    if bits >= FINE_BITS:
        scale, bias = grids[0]
    else:
        scale, bias = _least_error(groups, [_refitted_twice(groups, grid, top) for grid in grids], top)
    q = _codes(groups, scale, bias, top).astype(np.uint8).reshape(rows, cols)
    return pack_bits(q, bits), scale.astype(np.float32), bias.astype(np.float32)


def _starting_grids(low: np.ndarray, high: np.ndarray, top: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(scale, bias) per group: min-max first, its narrowed ranges, then the grids with zero on a level."""
    grids = []
    for share in NARROWED:
        centre, half = (high + low) / 2, (high - low) / 2 * share
        grids.append((2 * half / top, centre - half))
    for below in sorted({top // 2, (top + 1) // 2}):  # levels below zero
        scale = np.maximum(np.maximum(-low, 0) / below, np.maximum(high, 0) / (top - below))
        grids.append((scale, -below * scale))
    # a constant group: scale 1, every code 0 at min-max, whose bias is then the value itself
    return [(np.where(scale > 0, scale, np.float32(1)), bias) for scale, bias in grids]


def _least_error(
    groups: np.ndarray, grids: list[tuple[np.ndarray, np.ndarray]], top: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per group, the (scale, bias) of `grids` whose rounding is closest to the values (the first on a tie)."""
    best = None
    for scale, bias in grids:
        q = _codes(groups, scale, bias, top)
        error = ((q * scale[..., None] + bias[..., None] - groups) ** 2).sum(axis=-1)
        if best is None:
            best = [error, scale, bias]
        else:
            better = error < best[0]
            best = [np.where(better, new, old) for new, old in zip((error, scale, bias), best)]
    return best[1], best[2]


def _refitted_twice(groups: np.ndarray, grid: tuple[np.ndarray, np.ndarray], top: int) -> tuple[np.ndarray, np.ndarray]:
    scale, bias = grid
    for _ in range(REFITS):
        scale, bias = _refitted(groups, _codes(groups, scale, bias, top), scale, bias)
    return scale, bias


def _codes(groups: np.ndarray, scale: np.ndarray, bias: np.ndarray, top: int) -> np.ndarray:
    return np.clip(np.rint((groups - bias[..., None]) / scale[..., None]), 0, top)


def _refitted(groups: np.ndarray, q: np.ndarray, scale: np.ndarray, bias: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The least-squares scale and bias for codes q; the old ones where q is constant (or the fit not positive)."""
    q_mean, v_mean = q.mean(axis=-1), groups.mean(axis=-1)
    q_dev = q - q_mean[..., None]
    spread = (q_dev**2).mean(axis=-1)
    fitted = (q_dev * (groups - v_mean[..., None])).mean(axis=-1) / np.where(spread > 0, spread, 1)
    kept = (spread > 0) & (fitted > 0)
    scale = np.where(kept, fitted, scale).astype(np.float32)
    return scale, np.where(kept, v_mean - scale * q_mean, bias).astype(np.float32)
