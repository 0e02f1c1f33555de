"""The one home of what an adapter does to a weight: W + (a @ b)^T for LoRA, then DoRA's per-row rescaling.

Used three ways: DoRA's factor for per-row application (rows.py), the merged weights `mlxinfer convert --adapter`
quantizes (better than quantizing first), and nothing else re-derives it.
"""

from __future__ import annotations

import mlx.core as mx

from .reading import LowRank


def adapted(weight: mx.array, pair: LowRank) -> mx.array:
    """`weight` (out, in) plus the pair's update, in float32, before DoRA's rescaling."""
    return weight.astype(mx.float32) + (pair.a.astype(mx.float32) @ pair.b.astype(mx.float32)).T


def dora_factor(weight: mx.array, pair: LowRank) -> mx.array:
    """DoRA's rescaling of each output row, m / ||W + BA|| (float32, (out,)); the row norms run over the inputs,
    as mlx-lm's DoRALinear and PEFT's `get_weight_norm` take them."""
    assert pair.magnitude is not None
    return pair.magnitude.astype(mx.float32) / mx.linalg.norm(adapted(weight, pair), axis=1)


def fused(weight: mx.array, pair: LowRank) -> mx.array:
    """The merged weight (out, in), float32: what running the base with this pair computes, as one matrix."""
    merged = adapted(weight, pair)
    return merged if pair.magnitude is None else merged * dora_factor(weight, pair)[:, None]
