"""On a CPU, run a quantized model from float32 weights where that measures faster and fits.

MLX's CPU quantized matmul has no BLAS behind it: on 2 cores a 128-token prefill through one 576x1536 4-bit
layer takes ~90 ms, the same product from float32 weights through OpenBLAS (blas.py) ~1.6 ms. Dequantizing once at
load trades memory (8x the 4-bit bytes) for that speed, so it is done only where both hold:
- the float32 weights take at most DENSE_SHARE of the memory the planner sees, and
- on this machine, for this model's largest layer, float32 is faster both for a prefill chunk and for one
  decoded row (measured at load: it depends on the BLAS, the cores and the shapes, not on a table).
The head (lm_head, or a tied embedding) is decided apart: it multiplies one row per sequence a step (prefill
skips the rest), and a large vocabulary's head reads faster packed (Gemma 3's 262k rows: float32 1.3x slower
here). An embedding that is only looked up is never copied. Otherwise, and on a GPU (where decode is
bandwidth-bound and quantized kernels are fast), the weights stay as stored. MLXINFER_CPU_WEIGHTS=dense|quantized
overrides the choice; the loaded model reports what was kept, and why.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import (
    AllToShardedLinear,
    QuantizedAllToShardedLinear,
    QuantizedShardedToAllLinear,
    ShardedToAllLinear,
)
from mlx.utils import tree_unflatten

from ..errors import ConfigError
from .quantized import dense_weight, dequantize_blocks, widened

MODES = ("auto", "dense", "quantized")
DENSE_SHARE = 0.25  # float32 weights may take at most this share of the planner's usable memory
PREFILL_ROWS = 32  # a prefill chunk's worth of rows: enough for GEMM to pay, cheap to time at load
TIMED_BYTES = 64 << 20  # the float32 slice of a layer that is timed (_time_both)


@dataclass(frozen=True)
class WeightChoice:
    """What a loaded model computes from on this device, and why."""

    kept: str  # "quantized" (as stored), "dense" (dequantized to float32), or "as stored" (nothing quantized)
    reason: str


_SHARDED = (QuantizedAllToShardedLinear, QuantizedShardedToAllLinear)


def cpu_weights_mode(requested: str | None = None) -> str:
    mode = (requested or os.environ.get("MLXINFER_CPU_WEIGHTS") or "auto").lower()
    if mode not in MODES:
        raise ConfigError(f"MLXINFER_CPU_WEIGHTS={mode!r} is not one of {', '.join(MODES)}")
    return mode


def choose_cpu_weights(model: nn.Module, compute: mx.Dtype, usable_bytes: int, mode: str = "auto") -> WeightChoice:
    """Dequantize `model`'s quantized layers that multiply, in place, where that pays; says what it did.

    Embeddings only looked up (not the tied head) stay as stored whatever the mode: a lookup reads a few rows,
    so float32 copies of them would only hold memory (Llama 3 8B's untied 128k x 4096 table: 2 GiB)."""
    layers = quantized_layers(model)
    if not layers:
        return WeightChoice("as stored", "no quantized layers")
    if mode == "quantized":
        return WeightChoice("quantized", "MLXINFER_CPU_WEIGHTS=quantized")
    why_not = _unsuited(compute)
    if why_not:
        return WeightChoice("quantized", why_not)
    body, head = _roles(model, layers)
    if mode == "dense":
        chosen, reason = body | head, "MLXINFER_CPU_WEIGHTS=dense"
    else:
        chosen, reason = _worth_it(body, head, usable_bytes)
    if not chosen:
        return WeightChoice("quantized", reason)
    dequantize(model, chosen)
    _widen({name: m for name, m in (body | head).items() if name not in chosen})
    return WeightChoice("dense", reason)


def _widen(layers: dict[str, nn.Module]) -> None:
    """Hold the float scales and biases of quantized layers that multiply beside float32 ones in float32: once
    memory is traded for speed, quantized_matmul need not widen 16-bit ones at every call (5% of Gemma 3's
    decode here, where its tied 262k-row head stays quantized)."""
    for module in layers.values():
        module.scales, biases = widened(module.scales, module.get("biases"))
        if biases is not None:
            module.biases = biases
    mx.eval([m.parameters() for m in layers.values()])


def _roles(model: nn.Module, layers: dict[str, nn.Module]) -> tuple[dict[str, nn.Module], dict[str, nn.Module]]:
    """The quantized layers that multiply: the body's linears, and the head (models/decoder.py's `head`: lm_head,
    or the tied embedding), which multiplies one row per sequence at each step (prefill skips the rest)."""
    head_name = "lm_head" if "lm_head" in model else "model.embed_tokens"
    head = {name: m for name, m in layers.items() if name == head_name}
    body = {name: m for name, m in layers.items() if name != head_name and not isinstance(m, nn.QuantizedEmbedding)}
    return body, head


def _worth_it(body: dict[str, nn.Module], head: dict[str, nn.Module], usable_bytes: int) -> tuple[dict, str]:
    """What auto dequantizes here, and why: the body if float32 fits and times faster for a prefill chunk and
    for one decoded row on its largest layer; the head if it fits beside that and times faster for one row."""
    chosen, kept = {}, []
    for part, rows, label in ((body, (PREFILL_ROWS, 1), "layers"), (head, (1,), "head")):
        why_not = _why_not(part, rows, _dense_bytes(chosen), usable_bytes) if part else None
        if why_not:
            kept.append(f"{label}: {why_not}")
        else:
            chosen |= part
    if not chosen:
        return chosen, "; ".join(kept)
    return chosen, "float32 measured faster here" + (f" (kept quantized: {'; '.join(kept)})" if kept else "")


def _why_not(part: dict[str, nn.Module], rows: tuple[int, ...], held: int, usable_bytes: int) -> str | None:
    """Why `part` stays quantized beside `held` bytes already made float32: too big, or not faster here."""
    dense = _dense_bytes(part)
    if not dense_fits(held + dense, usable_bytes):
        return f"float32 weights ({(held + dense) / 2**30:.1f} GiB) would take over {DENSE_SHARE:.0%} of usable memory"
    largest = max(part.values(), key=_dense_elements)
    for n in rows:
        quantized, dense_s = _time_both(largest, n)
        if dense_s >= quantized:
            times = f"{dense_s * 1e3:.2f} ms vs {quantized * 1e3:.2f} ms, {n} row{'s' if n > 1 else ''}"
            return f"float32 measured no faster here ({times})"
    return None


def dequantize(model: nn.Module, layers: dict[str, nn.Module], dtype: mx.Dtype = mx.float32) -> None:
    """Swap each quantized layer for its float twin in `dtype` (the same values, on the quantization grid)."""
    swapped = []
    for name, module in layers.items():
        weight = dense_weight(module).astype(dtype)
        if isinstance(module, nn.QuantizedEmbedding):
            twin = nn.Embedding(*weight.shape)
        elif isinstance(module, _SHARDED):  # tensor parallel: the same share of the rows or columns, as floats
            twin = _sharded_twin(module, weight, dtype)
        else:
            twin = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in module)
            if "bias" in module:
                twin.bias = module.bias.astype(dtype)
        twin.weight = weight
        mx.eval(twin.parameters())  # one layer's temporaries at a time
        swapped.append((name, twin))
    model.update_modules(tree_unflatten(swapped))
    mx.eval(model.parameters())
    # The packed weights are free now; without this MLX keeps their buffers for reuse, and the process holds
    # both copies (a GGUF's packed bytes on top of the float32 ones).
    mx.clear_cache()


def _unsuited(compute: mx.Dtype) -> str | None:
    """Why float32 weights do not belong on this device at all (whatever MLXINFER_CPU_WEIGHTS says)."""
    if mx.default_device().type == mx.DeviceType.gpu:
        return "GPU: quantized kernels are fast and decode is bandwidth-bound"
    if compute != mx.float32:
        return f"computing in {compute}, not float32"
    return None


def dense_fits(dense_bytes: int, usable_bytes: int) -> bool:
    """Whether float32 weights of `dense_bytes` are within the share of usable memory dense weights may take."""
    return dense_bytes <= DENSE_SHARE * usable_bytes


def _time_both(layer: nn.Module, rows: int) -> tuple[float, float]:
    """Best-of-3 seconds for `rows` through `layer`'s first outputs (at most TIMED_BYTES of them as float32) as
    stored and from float32 weights (after a warm-up). A slice that large is past any cache, so both times are
    memory's, as the whole layer's are, and timing a 262k-row head never holds its whole float32 copy."""
    in_dims = _dense_elements(layer) // layer.weight.shape[0]
    kept = slice(0, max(1, TIMED_BYTES // (4 * in_dims)))
    packed, scales = layer.weight[kept], layer.scales[kept]
    biases = layer["biases"][kept] if "biases" in layer else None
    scales, biases = widened(scales, biases)  # as a layer kept quantized beside float32 ones is held (_widen)
    mode = getattr(layer, "mode", "affine")
    weight = dequantize_blocks(packed, scales, biases, layer.group_size, layer.bits, mode)
    x = mx.random.normal((rows, in_dims), key=mx.random.key(0))
    mx.eval(packed, scales, biases, weight, x)

    def best(run) -> float:
        mx.eval(run())  # warm-up: thread pools, first-touch pages
        times = []
        for _ in range(3):
            start = time.perf_counter()
            mx.eval(run())
            times.append(time.perf_counter() - start)
        return min(times)

    # The product alone: a tensor-parallel layer's sum across ranks must not run on one rank by itself.
    args = (scales, biases, True, layer.group_size, layer.bits)
    quantized = lambda: mx.quantized_matmul(x, packed, *args, mode=mode)  # noqa: E731
    return best(quantized), best(lambda: x @ weight.T)


def _sharded_twin(module: nn.Module, weight: mx.array, dtype: mx.Dtype) -> nn.Module:
    size, bias = module.group.size(), "bias" in module
    out_dims, in_dims = weight.shape
    if isinstance(module, QuantizedAllToShardedLinear):
        twin = AllToShardedLinear(in_dims, out_dims * size, bias, group=module.group)
    else:
        twin = ShardedToAllLinear(in_dims * size, out_dims, bias, group=module.group)
    if bias:
        twin.bias = module.bias.astype(dtype)
    return twin


def quantized_layers(model: nn.Module) -> dict[str, nn.Module]:
    """`model`'s quantized linear layers and embeddings, by path; experts (gather kernels) are left out."""
    kinds = (nn.QuantizedLinear, *_SHARDED)  # experts (gather kernels) stay as stored
    return {n: m for n, m in model.named_modules() if type(m) in kinds or isinstance(m, nn.QuantizedEmbedding)}


def _dense_bytes(layers: dict[str, nn.Module]) -> int:
    return sum(_dense_elements(m) for m in layers.values()) * 4


def _dense_elements(module: nn.Module) -> int:
    rows, packed = module.weight.shape[-2:]
    return rows * packed * 32 // module.bits
