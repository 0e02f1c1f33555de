"""Pick the dtype activations are computed in, by device.

MLX's CPU backend runs bf16 about 7x slower than float32 and its quantized
matmul is less accurate in half precision, so the CPU computes in float32.
Apple GPUs compute half precision natively: bfloat16 from the M2 on (Apple GPU
family g14+), float16 before it.
"""

from __future__ import annotations

import re

import mlx.core as mx

from ..errors import ConfigError

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def parse_dtype(name: str) -> mx.Dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ConfigError(f"dtype {name!r} is not one of {', '.join(DTYPES)}") from None


def choose_compute_dtype(requested: str | None = None) -> mx.Dtype:
    """The dtype to compute in on this device; `requested` (e.g. "float16") wins."""
    if requested:
        return parse_dtype(requested)
    if mx.default_device().type != mx.DeviceType.gpu:
        return mx.float32
    if not mx.metal.is_available():
        return mx.bfloat16  # CUDA backend
    return mx.bfloat16 if _apple_gpu_generation() >= 14 else mx.float16


def dtype_name(dtype: mx.Dtype) -> str:
    return next((name for name, d in DTYPES.items() if d == dtype), str(dtype))


def _apple_gpu_generation() -> int:
    arch = str(mx.device_info().get("architecture", ""))
    match = re.search(r"g(\d+)", arch)
    return int(match.group(1)) if match else 0
