"""GGUF Q4_K and Q5_K super-blocks -> MLX affine 4-/5-bit, group size 32, with the file's own codes.

A K-quant super-block holds 256 values as 8 sub-blocks of 32, each with a 6-bit scale sc and min m
under the block's f16 d and dmin: w = d*sc*q - dmin*m. Each sub-block is one MLX group with
scale = d*sc and bias = -dmin*m, both exact in float32 (an f16 mantissa times a 6-bit integer needs
17 bits; float16 would round them). Layout: ggml's block_q4_K / block_q5_K, as the `gguf` package's
quants.py reads them: https://github.com/ggml-org/llama.cpp/blob/master/ggml/src/ggml-common.h
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

Q4_K, Q5_K = 12, 13
BLOCK = 256  # values per super-block
SUB = 32  # values per sub-block: one MLX group
# type -> (bytes per super-block, bits per code)
K_BLOCKS = {Q4_K: (144, 4), Q5_K: (176, 5)}
CHUNK_VALUES = 1 << 22  # values converted at a time (by_rows): bounds the temporaries


def repack_k(raw: np.ndarray, rows: int, cols: int, ggml_type: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(packed uint32 (rows, cols*bits/32), scales and biases float32 (rows, cols/32), bits) of `raw`'s bytes."""
    block_bytes, bits = K_BLOCKS[ggml_type]
    blocks = raw.reshape(rows, cols // BLOCK, block_bytes)
    packed, scales, biases = by_rows(rows, cols, lambda part: _repack_rows(blocks[part], ggml_type, bits))
    return packed, scales, biases, bits


def by_rows(rows: int, cols: int, convert: Callable[[slice], tuple[np.ndarray, ...]]) -> tuple[np.ndarray, ...]:
    """convert(rows slice) for slices of about CHUNK_VALUES values, written into whole-tensor arrays allocated
    once: the temporaries of a conversion stay near one slice's, however large the tensor."""
    step = max(1, CHUNK_VALUES // cols)
    first = convert(slice(0, step))
    out = tuple(np.empty((rows, *part.shape[1:]), part.dtype) for part in first)
    for start in range(0, rows, step):
        for whole, part in zip(out, first if start == 0 else convert(slice(start, start + step)), strict=True):
            whole[start : start + len(part)] = part
    return out


def _repack_rows(blocks: np.ndarray, ggml_type: int, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One slice of rows: blocks (rows, supers, block bytes) -> packed codes, scales, biases."""
    rows = blocks.shape[0]
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)  # (rows, supers, 1)
    dmin = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = _scales_and_mins(blocks[..., 4:16])  # (rows, supers, 8) each
    scales = (d * sc).reshape(rows, -1)  # exact: an 11-bit mantissa times a 6-bit integer
    biases = -(dmin * m).reshape(rows, -1)
    # 128 bytes of nibbles: sub-blocks 2i and 2i+1 share bytes 32i..32i+31, low nibble then high.
    nibbles = blocks[..., -128:].reshape(rows, -1, 4, 1, 32)
    q = (nibbles >> np.array([0, 4], np.uint8).reshape(2, 1)) & 0x0F  # (rows, supers, 4, 2, 32)
    if ggml_type == Q5_K:
        # 32 bytes of high bits: bit j of byte k is the fifth bit of sub-block j's value k.
        high = blocks[..., 16:48].reshape(rows, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)
        q = q | ((high & 1) << 4).reshape(rows, -1, 4, 2, 32)
    return pack_bits(q.reshape(rows, -1), bits), scales, biases


def _scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's get_scale_min_k4 for all 8 sub-blocks: 12 bytes -> 6-bit scales and mins, as float32.

    Bytes 0-3 hold scales 0-3 (low 6 bits), bytes 4-7 mins 0-3; bytes 8-11 hold the low 4 bits of
    scales 4-7 (low nibble) and mins 4-7 (high nibble), whose top 2 bits are the top bits of bytes 0-7."""
    d, m, md = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mins.astype(np.float32)


def pack_bits(q: np.ndarray, bits: int) -> np.ndarray:
    """Codes (rows, cols) of 2 to 8 bits -> MLX's packed uint32 words: one little-endian bit stream per row,
    value k at bits [k*bits, (k+1)*bits) (at 3, 5 and 6 bits values straddle words); cols*bits % 32 == 0.

    Checked against mx.quantize in tests/test_gguf_kquants.py."""
    rows, cols = q.shape
    if 32 % bits:
        stream = (q.astype(np.uint8, copy=False)[..., None] >> np.arange(bits, dtype=np.uint8)) & 1
        packed = np.packbits(stream.reshape(rows, cols * bits), axis=-1, bitorder="little")
        return packed.view("<u4").astype(np.uint32, copy=False)
    per_word = 32 // bits
    words = q.reshape(rows, -1, per_word).astype(np.uint32)  # (rows, words, values per word)
    return np.bitwise_or.reduce(words << (np.arange(per_word, dtype=np.uint32) * bits), axis=-1)
