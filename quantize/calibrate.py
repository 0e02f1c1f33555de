"""GPTQ over a whole decoder, one block at a time.

Each block runs on the calibration tokens as the *already quantized* blocks
before it left them, so a block's rounding also makes up for the error that
reached its inputs. Within a block, every linear layer's input Hessian (sum of
x xᵀ) is recorded in one forward pass, its weights are GPTQ-rounded, and the
block's float weights are replaced by what the rounded ones stand for before
its outputs feed the next block. The output head (the tied embedding when the
model has one) is rounded last, on the final-norm hidden states.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .affine import dequantize_rows
from .gptq import gptq_quantize
from .recipes import LayerQuant

Triplet = tuple[mx.array, mx.array, mx.array]  # packed weight, scales, biases


class _Recorder(nn.Module):
    """Stands in for a linear layer: adds its input's x xᵀ and Σ|x| to `stats[key]`, then calls it."""

    def __init__(self, inner: nn.Module, key: str, stats: dict[str, tuple[mx.array, mx.array]]):
        super().__init__()
        self.inner, self.key, self.stats = inner, key, stats

    def __call__(self, x: mx.array) -> mx.array:
        flat = x.reshape(-1, x.shape[-1]).astype(mx.float32)
        gram, magnitude = flat.T @ flat, mx.abs(flat).sum(axis=0)
        if self.key in self.stats:
            previous = self.stats[self.key]
            gram, magnitude = gram + previous[0], magnitude + previous[1]
        self.stats[self.key] = (gram, magnitude)
        return self.inner(x)


def gptq_model(
    model: Any,
    tokens: mx.array,
    layers: dict[str, LayerQuant | None],
    dtype: mx.Dtype,
    progress: Callable[[], None] | None = None,
) -> dict[str, Triplet]:
    """GPTQ-rounded (packed, scales, biases) for every layer path in `layers` with a LayerQuant.

    `model` is a DecoderLM with float weights (changed in place to the rounded
    values); `tokens` is a (batch, length) array of calibration token ids.
    `progress` is called after each block and once after the output head.
    Layers GPTQ cannot see (an untied input embedding) are left out of the result.
    """
    results: dict[str, Triplet] = {}
    h = model.embed(tokens)
    for index, (block, kind) in enumerate(zip(model.layers, model.layout.layer_types)):
        mask = model.mask(tokens.shape[1], 0, kind)
        prefix = f"model.layers.{index}."
        for name, (hessian, _) in record_inputs(block, h, mask).items():
            quant = layers.get(prefix + name)
            if quant is not None:
                results[prefix + name] = _round(block, name, hessian, quant, dtype)
        h = block(h, mask, None)
        mx.eval(h)
        if progress:
            progress()
    head = "lm_head" if "lm_head" in model else "model.embed_tokens"
    if layers.get(head) is not None:
        final = model.model.norm(h).reshape(-1, h.shape[-1]).astype(mx.float32)
        results[head] = _round(model, head, final.T @ final, layers[head], dtype)
    if progress:
        progress()  # the head: as long as a few blocks when the vocabulary is large
    return results


def record_inputs(block: nn.Module, h: mx.array, mask: mx.array | None) -> dict[str, tuple[mx.array, mx.array]]:
    """{name: (x xᵀ, Σ|x|)} of every linear layer's inputs in `block` over one forward pass (the first: GPTQ's
    input Hessian)."""
    stats: dict[str, tuple[mx.array, mx.array]] = {}
    linears = [(name, m) for name, m in block.named_modules() if isinstance(m, nn.Linear)]
    for name, module in linears:
        set_child(block, name, _Recorder(module, name, stats))
    try:
        mx.eval(block(h, mask, None), stats)
    finally:
        for name, module in linears:
            set_child(block, name, module)
    return stats


def _round(owner: nn.Module, name: str, hessian: mx.array, quant: LayerQuant, dtype: mx.Dtype) -> Triplet:
    module = child(owner, name)
    weight = np.array(module.weight.astype(mx.float32))
    packed, scales, biases = gptq_quantize(weight, np.array(hessian), quant.bits, quant.group_size, dtype)
    rounded = dequantize_rows(packed, scales, biases, quant.bits, quant.group_size)
    module.weight = rounded.astype(module.weight.dtype)
    mx.eval(module.weight)
    return packed, scales, biases


def child(owner: Any, dotted: str) -> Any:
    """The submodule at a dotted path ("" is `owner`); a number indexes a list of blocks."""
    for part in dotted.split(".") if dotted else ():
        owner = owner[int(part)] if isinstance(owner, list) else getattr(owner, part)
    return owner


def set_child(owner: nn.Module, dotted: str, value: nn.Module) -> None:
    parent, _, leaf = dotted.rpartition(".")
    setattr(child(owner, parent) if parent else owner, leaf, value)
