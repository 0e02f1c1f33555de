"""The physical limit of decoding: memory bandwidth over the bytes read per token.

Decoding one token reads every weight once (of a mixture of experts, only the experts
it is routed to) plus the KV cache so far; with perfect overlap that bounds tokens/s
at bandwidth / bytes-per-token. On Apple GPUs
decode runs near that bound; on MLX's CPU backend it is compute-bound, so
engines reach only a small fraction of it there.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..models.config import normalize_config


@dataclass(frozen=True)
class Bandwidth:
    mlx_read_gbps: float  # summing a large array on MLX's default device
    numpy_read_gbps: float  # the same on the CPU with numpy, for reference
    array_bytes: int

    @property
    def best_gbps(self) -> float:
        return max(self.mlx_read_gbps, self.numpy_read_gbps)


def measure_bandwidth(array_bytes: int = 512 * 2**20, repeats: int = 5) -> Bandwidth:
    """Read bandwidth in GB/s (best of `repeats`), by reducing an array larger than caches."""
    n = array_bytes // 4
    a = mx.ones((n,), dtype=mx.float32)
    mx.eval(a)
    mlx_best = min(_timed(lambda: mx.eval(mx.sum(a))) for _ in range(repeats))
    b = np.ones(n, dtype=np.float32)
    numpy_best = min(_timed(lambda: float(b.sum())) for _ in range(repeats))
    return Bandwidth(array_bytes / mlx_best / 1e9, array_bytes / numpy_best / 1e9, array_bytes)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def kv_bytes_per_token(model_path: Path, dtype_bytes: int) -> int:
    """KV cache bytes one token adds across all layers."""
    raw = json.loads((model_path / "config.json").read_text()) if model_path.is_dir() else None
    if raw is None:
        from ..models.gguf import read_gguf

        raw = read_gguf(model_path)[0]
    args = normalize_config(raw).args
    return args["num_hidden_layers"] * 2 * args["num_key_value_heads"] * args["head_dim"] * dtype_bytes


def ceiling_tps(bandwidth_gbps: float, weights_bytes: int, kv_bytes: int, context_tokens: float) -> float:
    """Bandwidth-bound tokens/s when each step reads `weights_bytes` (all of a dense model's weights, an MoE
    model's dense ones and active experts: ModelFootprint.decode_weights_bytes) and the KV cache."""
    return bandwidth_gbps * 1e9 / (weights_bytes + kv_bytes * context_tokens)
