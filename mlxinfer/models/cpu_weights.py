"""On a CPU, run a quantized model from float32 weights where that measures faster and fits.

MLX's CPU quantized matmul has no BLAS behind it: on 2 cores a 128-token prefill through one 576x1536 4-bit
layer takes ~90 ms, the same product from float32 weights through OpenBLAS (blas.py) ~1.6 ms. Dequantizing once at
load trades memory (8x the 4-bit bytes) for that speed, so it is done only where both hold:
- the float32 weights take at most DENSE_SHARE of the memory the planner sees, and
- on this machine, for this model's largest layer, float32 is faster both for a prefill chunk and for one
  decoded row (measured at load: it depends on the BLAS, the cores and the shapes, not on a table).
Otherwise, and on a GPU (where decode is bandwidth-bound and quantized kernels are fast), the weights stay as
stored. MLXINFER_CPU_WEIGHTS=dense|quantized overrides the choice; the loaded model reports what was kept.
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

MODES = ("auto", "dense", "quantized")
DENSE_SHARE = 0.25  # float32 weights may take at most this share of the planner's usable memory
PREFILL_ROWS = 32  # a prefill chunk's worth of rows: enough for GEMM to pay, cheap to time at load


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
    """Dequantize `model`'s quantized linear and embedding layers in place where that pays; says what it did."""
    layers = _quantized(model)
    if not layers:
        return WeightChoice("as stored", "no quantized layers")
    if mode == "quantized":
        return WeightChoice("quantized", "MLXINFER_CPU_WEIGHTS=quantized")
    why_not = _unsuited(compute) or (_not_worth_it(layers, usable_bytes) if mode == "auto" else None)
    if why_not:
        return WeightChoice("quantized", why_not)
    dequantize(model, layers)
    return WeightChoice("dense", "MLXINFER_CPU_WEIGHTS=dense" if mode == "dense" else "float32 measured faster here")


def dequantize(model: nn.Module, layers: dict[str, nn.Module]) -> None:
    """Swap each quantized layer for its float32 twin (the same values, on the quantization grid)."""
    swapped = []
    for name, module in layers.items():
        weight = _dense_weight(module)
        if isinstance(module, nn.QuantizedEmbedding):
            twin = nn.Embedding(*weight.shape)
        elif isinstance(module, _SHARDED):  # tensor parallel: the same share of the rows or columns, as floats
            twin = _sharded_twin(module, weight)
        else:
            twin = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in module)
            if "bias" in module:
                twin.bias = module.bias.astype(mx.float32)
        twin.weight = weight
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


def _not_worth_it(layers: dict[str, nn.Module], usable_bytes: int) -> str | None:
    """Why auto keeps the stored weights here: too big for the memory, or not faster on this machine."""
    dense = sum(_dense_elements(m) for m in layers.values()) * 4
    if not dense_fits(dense, usable_bytes):
        return f"float32 weights ({dense / 2**30:.1f} GiB) would take over {DENSE_SHARE:.0%} of usable memory"
    linears = (m for m in layers.values() if not isinstance(m, nn.QuantizedEmbedding))
    largest = max(linears, key=_dense_elements, default=None)
    if largest is None:
        return "only embeddings are quantized"
    for rows in (PREFILL_ROWS, 1):
        quantized, dense_s = _time_both(largest, rows)
        if dense_s >= quantized:
            return f"float32 measured no faster here ({dense_s * 1e3:.2f} ms vs {quantized * 1e3:.2f} ms, {rows} rows)"
    return None


def _time_both(layer: nn.Module, rows: int) -> tuple[float, float]:
    """Best-of-3 seconds for `rows` through `layer` as stored and from float32 weights (after a warm-up)."""
    weight = _dense_weight(layer)
    x = mx.random.normal((rows, weight.shape[1]), key=mx.random.key(0))
    mx.eval(weight, x)

    def best(run) -> float:
        mx.eval(run())  # warm-up: thread pools, first-touch pages
        times = []
        for _ in range(3):
            start = time.perf_counter()
            mx.eval(run())
            times.append(time.perf_counter() - start)
        return min(times)

    # The product alone: a tensor-parallel layer's sum across ranks must not run on one rank by itself.
    args = (layer.scales, layer.get("biases"), True, layer.group_size, layer.bits)
    quantized = lambda: mx.quantized_matmul(x, layer.weight, *args, mode=getattr(layer, "mode", "affine"))  # noqa: E731
    return best(quantized), best(lambda: x @ weight.T)


def _sharded_twin(module: nn.Module, weight: mx.array) -> nn.Module:
    size, bias = module.group.size(), "bias" in module
    out_dims, in_dims = weight.shape
    if isinstance(module, QuantizedAllToShardedLinear):
        twin = AllToShardedLinear(in_dims, out_dims * size, bias, group=module.group)
    else:
        twin = ShardedToAllLinear(in_dims * size, out_dims, bias, group=module.group)
    if bias:
        twin.bias = module.bias.astype(mx.float32)
    return twin


def _quantized(model: nn.Module) -> dict[str, nn.Module]:
    kinds = (nn.QuantizedLinear, nn.QuantizedEmbedding, *_SHARDED)  # experts (gather kernels) stay as stored
    return {name: m for name, m in model.named_modules() if type(m) in kinds}


def _dense_weight(module: nn.Module) -> mx.array:
    args = (module.weight, module.scales, module.get("biases"), module.group_size, module.bits)
    return mx.dequantize(*args, mode=getattr(module, "mode", "affine")).astype(mx.float32)


def _dense_elements(module: nn.Module) -> int:
    rows, packed = module.weight.shape[-2:]
    return rows * packed * 32 // module.bits
