"""Distilled scales (DWQ-style, as mlx-lm's `dwq`): fit the quantized model's scales and biases to the float model.

Round-to-nearest (or GPTQ) fixes each weight's code. Here the codes stay as they are, and every quantized layer's
per-group scales and biases are trained by gradient descent so that the quantized model's next-token distributions
match the float model's (the KL divergence on calibration text), through the whole network at once: an error one
layer makes can be taken up by the layers after it, which no per-layer rounding can do.

The layers are held as codes (uint8) plus float32 scales and biases and their learned shifts while training, and
dequantized in each forward pass with plain array operations, so the gradient needs no quantized-kernel support and
the matrix products run on the backend's dense kernels; each block's dequantized weights are recomputed in the
backward pass rather than held (8 bytes a parameter otherwise). The float model's distributions are computed once,
before its weights are replaced, and only their most likely `TOP_K` tokens are kept one by one (all of them would
cost vocab-size memory per position); the loss counts the rest as one outcome, so the tail's mass is matched too
(held-out perplexity +13.6% without that term, +10.3% with it: bench/README.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from .affine import quantize_rows
from .calibrate import child
from .gptq import pack
from .recipes import LayerQuant

Triplet = tuple[mx.array, mx.array, mx.array]  # packed weight, scales, biases
Target = tuple[mx.array, mx.array]  # the teacher's top token ids per position, their log-probabilities
# Teacher tokens kept per position, and Adam's step on each group's scale and bias in units of its starting scale.
# Measured on held-out code, prose and chat (bench/README.md): 256 and 1e-3 gave +12.4/+6.2/+12.4%, 1024 and 1e-3
# +11.8/+5.6/+12.2%, 1024 and 2e-3 +26.0/+14.9/+34.4%, 1024 and 5e-4 +10.9/+7.1/+9.7% with the lowest KL.
TOP_K = 1024
LEARNING_RATE = 5e-4


class _Codes(nn.Module):
    """A linear layer or embedding held as fixed codes, with trainable per-group scales and biases.

    What trains is each group's change in units of its starting scale (its grid step): `scale_shift` stretches
    the step, `bias_shift` slides the grid. In those units one learning rate suits every bit width; in the
    weights' own units Adam moves an 8-bit group's step (16x finer than a 4-bit one's) by 16x more of itself
    per update, and a mixed recipe's 8-bit layers come out worse than they went in."""

    TRAINED = ("scale_shift", "bias_shift")

    def __init__(self, module: nn.Module, quant: LayerQuant, start: Triplet | None, dtype: mx.Dtype):
        super().__init__()
        weight = module.weight
        packed, scales, biases = start or quantize_rows(weight, quant.bits, quant.group_size, dtype)
        self.bits, self.group_size = quant.bits, quant.group_size
        self.codes = _unpack(packed, quant.bits, weight.shape[-1])
        self.base_scales, self.base_biases = scales.astype(mx.float32), biases.astype(mx.float32)
        self.scale_shift, self.bias_shift = mx.zeros_like(self.base_scales), mx.zeros_like(self.base_biases)
        self.bias = module.bias if "bias" in module else None
        self.embedding = isinstance(module, nn.Embedding)
        self.freeze()
        self.unfreeze(keys=list(self.TRAINED), recurse=False)

    def scales_and_biases(self) -> tuple[mx.array, mx.array]:
        step = self.base_scales
        return step * (1 + self.scale_shift), self.base_biases + step * self.bias_shift

    def dense(self, rows: mx.array | None = None) -> mx.array:
        codes, (scales, biases) = self.codes, self.scales_and_biases()
        if rows is not None:
            codes, scales, biases = codes[rows], scales[rows], biases[rows]
        grouped = codes.reshape(*codes.shape[:-1], -1, self.group_size).astype(mx.float32)
        return (grouped * scales[..., None] + biases[..., None]).reshape(codes.shape)

    def __call__(self, x: mx.array) -> mx.array:
        if self.embedding:
            return self.dense(x)
        return self.as_linear(x)

    def as_linear(self, x: mx.array) -> mx.array:
        y = x @ self.dense().T.astype(x.dtype)
        return y if self.bias is None else y + self.bias

    def triplet(self, dtype: mx.Dtype) -> Triplet:
        packed = mx.array(pack(np.array(self.codes), self.bits))
        scales, biases = self.scales_and_biases()
        return packed, scales.astype(dtype), biases.astype(dtype)


def teacher_targets(model: Any, batches: list[mx.array]) -> list[Target]:
    """The float model's `TOP_K` likeliest tokens per position of each batch, and their log-probabilities."""
    targets = []
    for tokens in batches:
        logprobs = nn.log_softmax(model(tokens).astype(mx.float32), axis=-1)
        k = min(TOP_K, logprobs.shape[-1])
        # A copy: the slice alone would keep the whole vocabulary-wide argpartition alive (rows x length x vocab).
        indices = mx.contiguous(mx.argpartition(-logprobs, kth=k - 1, axis=-1)[..., :k])
        targets.append((indices, mx.take_along_axis(logprobs, indices, axis=-1)))
        mx.eval(targets[-1])
    return targets


def distill_model(
    model: Any,
    batches: list[mx.array],
    targets: list[Target],
    layers: dict[str, LayerQuant | None],
    dtype: mx.Dtype,
    start: dict[str, Triplet] | None,
    epochs: int,
    learning_rate: float = LEARNING_RATE,
    progress: Callable[[float], None] | None = None,
) -> dict[str, Triplet]:
    """(packed, scales, biases) for every path in `layers` with a LayerQuant, scales and biases distilled.

    `model` is a DecoderLM (its layers are replaced in place); `batches` are (rows, length) token arrays and
    `targets` the float model's distributions on them (`teacher_targets`); `start` gives a layer's codes and
    starting scales (GPTQ's, say), else it is rounded to nearest from the layer's weight.
    `progress` is called after each step with the step's loss."""
    held = _swap_in(model, layers, start or {}, dtype)
    model.freeze()
    for module in held.values():
        module.unfreeze(keys=list(module.TRAINED), recurse=False)
    blocks = model.model.layers
    model.model.layers = [_Recomputed(block) for block in blocks]
    optimizer = optim.Adam(learning_rate=learning_rate, bias_correction=True)
    step = nn.value_and_grad(model, _loss)
    try:
        for _ in range(epochs):
            for tokens, target in zip(batches, targets):
                loss, grads = step(model, tokens, *target)
                optimizer.update(model, grads)
                mx.eval(model.trainable_parameters(), optimizer.state, loss)
                if progress:
                    progress(loss.item())
    finally:
        model.model.layers = blocks
    return {path: module.triplet(dtype) for path, module in held.items()}


class _Recomputed(nn.Module):
    """A block whose inner values (each layer's dequantized weights among them, 8 bytes a parameter) are
    recomputed in the backward pass instead of held from the forward one: the training step then holds one
    block's worth at a time, for one more forward pass."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def __call__(self, h: mx.array, mask: Any, cache: Any) -> mx.array:
        def run(params: dict, h: mx.array) -> mx.array:
            self.block.update(params)
            return self.block(h, mask, cache)

        return mx.checkpoint(run)(self.block.trainable_parameters(), h)


def _loss(model: Any, tokens: mx.array, indices: mx.array, teacher: mx.array) -> mx.array:
    """KL(float || quantized) per position, averaged: over the teacher's likeliest tokens one by one and the rest
    of the vocabulary as one more outcome (so the tail's total mass is matched too, not left to drift)."""
    student = nn.log_softmax(model(tokens).astype(mx.float32), axis=-1)
    student = mx.take_along_axis(student, indices, axis=-1)
    head = mx.sum(mx.exp(teacher) * (teacher - student), axis=-1)
    teacher_tail, student_tail = _tail(teacher), _tail(student)
    return mx.mean(head + mx.exp(teacher_tail) * (teacher_tail - student_tail))


def _tail(logprobs: mx.array) -> mx.array:
    """log of the probability outside the given tokens."""
    return mx.log1p(-mx.minimum(mx.sum(mx.exp(logprobs), axis=-1), 1 - 1e-6))


def _swap_in(
    model: Any, layers: dict[str, LayerQuant | None], start: dict[str, Triplet], dtype: mx.Dtype
) -> dict[str, _Codes]:
    held = {}
    for path, quant in layers.items():
        if quant is None:
            continue
        parent, _, leaf = path.rpartition(".")
        owner = child(model, parent)
        held[path] = _Codes(getattr(owner, leaf), quant, start.get(path), dtype)
        setattr(owner, leaf, held[path])
        mx.eval(held[path].parameters())
    return held


def _unpack(packed: mx.array, bits: int, columns: int) -> mx.array:
    """Codes (uint8, one per weight) of MLX-packed rows: each row a little-endian bit stream in uint32 words."""
    raw = np.array(packed).view(np.uint8)
    planes = np.unpackbits(raw, axis=-1, bitorder="little")[..., : columns * bits]
    planes = planes.reshape(*raw.shape[:-1], columns, bits)
    return mx.array((planes << np.arange(bits, dtype=np.uint8)).sum(axis=-1, dtype=np.uint8))
