"""Llama 3.1's RoPE scaling, stored in GGUF as a `rope_freqs` tensor, read back as config parameters.

llama.cpp's converter (LlamaModel.generate_extra_tensors) turns rope_scaling {factor, low_freq_factor,
high_freq_factor, original_max_position_embeddings} into one divisor per rotary frequency and writes
no metadata for it. The divisors depend on the parameters only through two numbers (the band edges),
so we recover parameters that give the same divisors, recompute the tensor from them and compare:
a tensor that no llama3 setting reproduces is refused, never ignored.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..errors import UnsupportedModelError
from ..formats.gguf_file import GGUFFile

# Llama 3.1 / 3.2: what every released checkpoint uses (tried first; the fit below covers the rest).
_KNOWN = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def llama3_divisors(head_dim: int, theta: float, scaling: dict[str, Any]) -> np.ndarray:
    """rope_freqs as llama.cpp writes it: the divisor of each inverse frequency (transformers' llama3 rule)."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    divisors = np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, 0.0))
    medium = divisors == 0.0
    divisors[medium] = 1.0 / ((1 - smooth[medium]) / factor + smooth[medium])
    return divisors


def llama3_from_rope_freqs(gguf: GGUFFile, config: dict[str, Any]) -> dict[str, Any] | None:
    """The llama3 rope_scaling whose divisors equal the file's rope_freqs tensor (None when all are 1)."""
    where = f"{gguf.path}: GGUF tensor rope_freqs.weight"
    head_dim, theta = config["head_dim"], config["rope_theta"]
    stored = gguf.read("rope_freqs.weight")
    if not isinstance(stored, np.ndarray) or stored.shape != (head_dim // 2,) or stored.dtype != np.float32:
        raise UnsupportedModelError(f"{where} must be {head_dim // 2} float32 values, one per rotary frequency")
    divisors = stored.astype(np.float64)
    if not np.all(np.isfinite(divisors)) or divisors.min() <= 0:
        raise UnsupportedModelError(f"{where} holds values that are not positive finite numbers")
    if np.allclose(divisors, 1.0):
        return None
    factor = float(divisors.max())
    candidates = [{"factor": factor, **_KNOWN}, _fit(divisors, factor, head_dim, theta)]
    for scaling in filter(None, candidates):
        if np.allclose(llama3_divisors(head_dim, theta, scaling), divisors, rtol=1e-5, atol=0):
            return {"rope_type": "llama3", **scaling}
    raise UnsupportedModelError(
        f"{where} is not a llama3 RoPE scaling (no factor/low/high/original setting reproduces it); "
        "use the model's Hugging Face checkpoint"
    )


def _fit(divisors: np.ndarray, factor: float, head_dim: int, theta: float) -> dict[str, Any] | None:
    """Band edges that give these divisors. With u = 1 / wavelength, the smoothing is linear in u:
    smooth = (u - u0) / (u1 - u0), u0 = low / original, u1 = high / original. Two or more smoothed
    frequencies fix u0 and u1; with fewer, any edges between the bands reproduce the tensor."""
    if factor <= 1:
        return None
    u = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim) / (2 * math.pi)
    unscaled, full = divisors <= 1 + 1e-6, divisors >= factor * (1 - 1e-6)
    medium = ~unscaled & ~full
    top = u[unscaled].min() if unscaled.any() else u.max() * 2  # the smallest u left unscaled
    bottom = u[full].max() if full.any() else u.min() / 2  # the largest u fully scaled
    smooth = (1 / divisors[medium] - 1 / factor) / (1 - 1 / factor)
    if medium.sum() >= 2:
        slope, cut = np.polyfit(u[medium], smooth, 1)
        if slope <= 0:
            return None
        u0, u1 = -cut / slope, (1 - cut) / slope
    elif medium.sum() == 1:
        (um,), (sm,) = u[medium], smooth
        u1 = math.sqrt(um * top)
        u0 = (um - sm * u1) / (1 - sm)
    else:
        u0, u1 = bottom * (top / bottom) ** (1 / 3), bottom * (top / bottom) ** (2 / 3)
    if not 0 < u0 < u1:
        return None
    original = _KNOWN["original_max_position_embeddings"]
    return {
        "factor": factor,
        "low_freq_factor": float(u0 * original),
        "high_freq_factor": float(u1 * original),
        "original_max_position_embeddings": original,
    }
