"""What one tensor of a conversion's output holds, and the KV width the quality report's caches take."""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
from mlxinfer.quantize import LayerQuant

from mlxinfer.models.config import ModelConfig


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
