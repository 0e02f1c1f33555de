"""What one tensor of a conversion's output holds, what converting it holds, and the KV width the quality report's
caches take."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlxinfer.quantize import LayerQuant
from mlxinfer.quantize.affine import ROW_BLOCK_ELEMENTS

from mlxinfer.models.config import ModelConfig
from mlxinfer.models.quantized import DEQUANTIZE_BLOCK_ELEMENTS


@dataclass(frozen=True)
class MXFP4Quant(LayerQuant):
    """A GGUF MXFP4 layer (gpt-oss's experts) kept as stored: MLX mxfp4, 4-bit E2M1 codes in groups of 32,
    one power-of-two (E8M0) scale each and no biases. Copied, never rounded: no affine grid holds it exactly."""

    bits: int = 4
    group_size: int = 32
    mode: str = "mxfp4"


def written_bytes(shape: tuple[int, ...], quant: LayerQuant | None, dtype: mx.Dtype) -> int:
    count = math.prod(shape)
    if quant is None:
        return count * dtype.size
    if quant.mode != "affine":  # a float format (MXFP4Quant's too): packed codes and a one-byte scale per group
        return count * quant.bits // 8 + count // quant.group_size
    return count * quant.bits // 8 + 2 * (count // quant.group_size) * dtype.size  # packed, scales and biases


def kv_width(config: ModelConfig) -> int:
    """K (or V) elements per position in one layer; an unverified config may leave head_dim to its module."""
    args = config.args
    heads = int(args.get("num_attention_heads") or 1)
    return int(args.get("num_key_value_heads") or heads) * int(args.get("head_dim") or config.hidden_size // heads)


# The process while the tensor stream runs, before any tensor: Python, MLX, the tokenizer and the plan. Measured
# 68-108 MiB (SmolLM2-135M from bf16 and from GGUF, Gemma 3 270M from GGUF; bench/README.md, "Converter peaks"):
# 90 MiB keeps every measured forecast between -5% and +15% of its peak.
STREAM_RUNTIME_BYTES = 90 * 2**20
MAPPED_FLOATS = ("F16", "BF16", "F32")  # GGUF float tensors: read as views of the file's map


def stream_peak_bytes(
    source: Any,
    shapes: dict[str, tuple[int, ...]],
    layers: dict[str, LayerQuant | None],
    dtype: mx.Dtype,
    grids: dict[str, tuple[int, int]],
) -> int:
    """The tensor stream's peak: the runtime, a GGUF file's mapped pages, and the most one output tensor holds
    while it is made (shards are written tensor by tensor, convert/writer.py: no pending shard is held).

    Per tensor: its source bytes as read (a tensor made from several, fused or split, counts the largest source
    tensor), plus what is made of them: a copy of codes already on the output's grid (`grids`: a GGUF type's),
    or float32 values (a block of rows at a time, quantize/affine.py) and the written tensor."""
    largest_read = max((t.nbytes for t in source.tensors.values()), default=0)
    held = 0
    mapped = getattr(source, "mapped_bytes", 0)
    for name, shape in shapes.items():
        stored = source.tensors.get(name)
        read = stored.nbytes if stored is not None else largest_read
        if mapped and stored is not None and stored.dtype in MAPPED_FLOATS:
            read = 0  # the mapped pages themselves, counted with the file (a GGUF's F16 tensor is not copied)
        quant = layers.get(name.removesuffix(".weight")) if name.endswith(".weight") else None
        grid = grids.get(stored.dtype) if stored is not None else None
        count = math.prod(shape)
        if copied(quant, stored.dtype if stored is not None else "", grid):
            work = 2 * read  # the codes as read, and their copy
        elif quant is None:
            work = read + written_bytes(shape, None, dtype)
        else:
            work = (
                read
                + _float_bytes(count, grid, stored.dtype if stored is not None else "")
                + written_bytes(shape, quant, dtype)
            )
        held = max(held, work)
    return STREAM_RUNTIME_BYTES + mapped + held


def copied(quant: LayerQuant | None, stored: str, grid: tuple[int, int] | None) -> bool:
    """Whether the output tensor is the source's codes copied (on its GGUF grid, or MXFP4 kept as mxfp4)."""
    if quant is None:
        return False
    return (quant.mode, stored) == ("mxfp4", "MXFP4") or (
        quant.mode == "affine" and grid == (quant.bits, quant.group_size)
    )


def _float_bytes(count: int, grid: tuple[int, int] | None, stored: str) -> int:
    """The float32 values quantizing a tensor of `count` values holds. From a GGUF grid, a block of
    DEQUANTIZE_BLOCK_ELEMENTS at a time and MLX's dequantize temporaries beside it: up to 7x its values, at 6 bits
    (models/quantized.py). From floats, a row block's (quantize/affine.py), cast from 16 bits, or, from float32
    (no cast), about half a block of MLX's own temporaries (measured on SmolLM2-135M's embedding: bench/README.md,
    "Converter peaks")."""
    if grid is not None:
        return 7 * 4 * min(count, DEQUANTIZE_BLOCK_ELEMENTS)
    block = min(4 * count, 4 * ROW_BLOCK_ELEMENTS)
    return block // 2 if stored == "F32" else block
