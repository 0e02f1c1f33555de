"""Activation-aware scaling (AWQ, Lin et al. 2023) before rounding to nearest.

A few input channels of each linear layer carry much larger activations than the rest; their weights matter
more to the layer's outputs. AWQ multiplies those input columns by s (so that rounding loses relatively less
of them) and divides the operation that feeds the layer by s, which leaves the float model's function
unchanged: a norm's weight (RMSNorm's w / s; Gemma's (1 + w) / s - 1), or the rows of the linear layer before
it (up_proj's, for down_proj). Per group of layers sharing one input, s = mean|x|^a over the calibration
tokens, a searched on a grid for the least output error of the rounded layers, measured through each layer's
input Hessian: ||X (W - Ŵ)ᵀ||² = tr((W - Ŵ) H (W - Ŵ)ᵀ). The paper's second step, clipping each group's range
before rounding (mlx-lm's awq has it), was tried here and left out: searched the same way, it moved SmolLM2's
held-out perplexity change from +33.7% to +34.9% (bench/README.md).

Which norm feeds which layers is read from the block's modules (the llama-style names mlx-lm's families use),
and every fold is checked: the block must compute what it computed before (to float32 rounding), else the
other fold is tried, else that group stays unscaled. The result is float weights; the converter rounds them
to nearest in the usual format.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .calibrate import child, record_inputs
from .recipes import LayerQuant

GRID = 20  # exponents a = 0, 0.05, ..., 0.95, as the paper and mlx-lm's awq
FOLD_TOLERANCE = 1e-3  # the scaled block's outputs against the float block's, relative to their largest value
# (feeding operation, the layers it feeds): the first candidate per feeder whose modules the block has, no layer
# scaled twice.
GROUPS = (
    ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("input_layernorm", ("self_attn.qkv_proj",)),
    ("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj")),  # Gemma 2/3: post_attention_layernorm is not
    ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),  # the MLP's input there
    ("post_attention_layernorm", ("mlp.gate_up_proj",)),
    ("mlp.up_proj", ("mlp.down_proj",)),
)


def awq_model(
    model: Any,
    tokens: mx.array,
    layers: dict[str, LayerQuant | None],
    progress: Callable[[], None] | None = None,
) -> dict[str, mx.array]:
    """Scale `model`'s blocks in place (a DecoderLM with float weights) for rounding to nearest with `layers`'
    formats, on `tokens` (batch, length); returns {tensor name: its new float value} of every tensor changed."""
    changed: dict[str, mx.array] = {}
    h = model.embed(tokens)
    for index, (block, kind) in enumerate(zip(model.layers, model.layout.layer_types)):
        mask = model.mask(tokens.shape[1], 0, kind)
        run, stats = partial(block, h, mask, None), record_inputs(block, h, mask)
        h = _scale_block(block, run, stats, f"model.layers.{index}.", layers, changed)
        mx.eval(h, changed)
        if progress:
            progress()
    return changed


def _scale_block(block: nn.Module, run: Callable[[], mx.array], stats: dict, prefix: str, layers: dict, changed: dict):
    """Scale each group of `block` (`run`: the block on its inputs); returns its outputs, which do not change."""
    reference = run()
    mx.eval(reference)
    for feeder, fed in _groups(block):
        quants = [layers.get(prefix + name) for name in fed]
        if not any(quants) or fed[0] not in stats:
            continue
        scales = _search(block, fed, quants, *stats[fed[0]])
        if _fold(block, feeder, fed, scales, run, reference):
            for name in (feeder, *fed):
                changed[f"{prefix}{name}.weight"] = child(block, name).weight
            if isinstance(getattr(child(block, feeder), "bias", None), mx.array):
                changed[f"{prefix}{feeder}.bias"] = child(block, feeder).bias
    return reference


def _groups(block: nn.Module) -> list[tuple[str, tuple[str, ...]]]:
    """(feeder, fed layers) of GROUPS that this block has, one per feeder (or per fed layer set)."""
    found, feeders, scaled = [], set(), set()
    for feeder, fed in GROUPS:
        if feeder in feeders or scaled & set(fed) or not all(_has(block, n) for n in (feeder, *fed)):
            continue
        found.append((feeder, fed))
        feeders.add(feeder)
        scaled |= set(fed)
    return found


def _search(block: nn.Module, fed: tuple[str, ...], quants: list, gram: mx.array, magnitude: mx.array) -> mx.array:
    """The input scales of `fed` (sharing one input) that round with the least output error."""
    weights = [child(block, name).weight.astype(mx.float32) for name in fed]
    mean = mx.maximum(magnitude / magnitude.mean(), 1e-8)  # any constant factor cancels in the normalization
    best, best_error = mx.ones_like(mean), float("inf")
    for step in range(GRID):
        scales = mx.maximum(mean ** (step / GRID), 1e-4)
        scales = scales / mx.sqrt(scales.max() * scales.min())
        error = sum(
            (_output_error(w, scales, q, gram) for w, q in zip(weights, quants) if q is not None), mx.array(0.0)
        )
        if error.item() < best_error:
            best, best_error = scales, error.item()
    return best


def _output_error(weight: mx.array, scales: mx.array, quant: LayerQuant, gram: mx.array) -> mx.array:
    """tr(Δ H Δᵀ) for Δ = W - Q(W s) / s: the squared output error of the rounded layer over the recorded inputs."""
    packed, q_scales, biases = mx.quantize(weight * scales, group_size=quant.group_size, bits=quant.bits)
    rounded = mx.dequantize(packed, q_scales, biases, group_size=quant.group_size, bits=quant.bits) / scales
    delta = weight - rounded
    return ((delta @ gram) * delta).sum()


def _fold(block, feeder: str, fed, scales: mx.array, run: Callable[[], mx.array], reference: mx.array) -> bool:
    """Multiply `fed`'s input columns by `scales` and divide `feeder` by them, in the first way that leaves the
    block's outputs as they were; restore everything and return False when none does."""
    saved = {name: dict(child(block, name).parameters()) for name in (feeder, *fed)}
    for divide in (_divide_plain, _divide_offset):
        module = child(block, feeder)
        if not divide(module, scales):
            continue
        for name in fed:
            layer = child(block, name)
            layer.weight = (layer.weight.astype(mx.float32) * scales).astype(layer.weight.dtype)
        out = run()
        drift = (mx.abs(out - reference).max() / mx.maximum(mx.abs(reference).max(), 1e-6)).item()
        if drift <= FOLD_TOLERANCE:
            return True
        for name, params in saved.items():
            child(block, name).update(params)
    return False


def _divide_plain(module: nn.Module, scales: mx.array) -> bool:
    """A norm's weight (and bias) or a linear layer's output rows, divided by `scales`."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, mx.array):
        return False
    shaped = scales[:, None] if weight.ndim == 2 else scales
    if weight.shape[0] != scales.shape[0]:
        return False
    module.weight = (weight.astype(mx.float32) / shaped).astype(weight.dtype)
    if isinstance(getattr(module, "bias", None), mx.array):
        module.bias = (module.bias.astype(mx.float32) / scales).astype(module.bias.dtype)
    return True


def _divide_offset(module: nn.Module, scales: mx.array) -> bool:
    """A norm that multiplies by (1 + w), as Gemma's: w becomes (1 + w) / s - 1."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, mx.array) or weight.ndim != 1 or isinstance(module, nn.Linear):
        return False
    module.weight = ((1.0 + weight.astype(mx.float32)) / scales - 1.0).astype(weight.dtype)
    return True


def _has(owner: nn.Module, dotted: str) -> bool:
    try:
        child(owner, dotted)
    except (AttributeError, KeyError):
        return False
    return True
