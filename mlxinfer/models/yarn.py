"""YaRN RoPE settings read the way transformers reads them (`_compute_yarn_parameters` in
transformers/modeling_rope_utils.py), and the inverse frequencies it computes from them.

mlx-lm's YarnRoPE always rounds the correction range to whole dimensions and derives its attention
factor by its own rule; transformers skips the rounding when `truncate` is false (gpt-oss) and takes an
explicit `attention_factor` first. Pure Python: config.py resolves the settings before anything is built.
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import ConfigError, UnsupportedModelError
from ..formats.safetensors_header import MAX_DIM
from ..untrusted import is_finite_number, is_int, shown

# Every key transformers' YaRN reads; another one is refused rather than ignored.
YARN_KEYS = frozenset(
    {"rope_type", "type", "rope_theta", "partial_rotary_factor", "factor", "original_max_position_embeddings",
     "beta_fast", "beta_slow", "truncate", "attention_factor", "mscale", "mscale_all_dim"}
)  # fmt: skip


def yarn_scaling(scaling: dict[str, Any], args: dict[str, Any], source: str) -> dict[str, Any]:
    """`scaling` (rope_parameters or rope_scaling of type yarn) with every value resolved as transformers does.

    `args` supplies the top-level `original_max_position_embeddings` (which wins, as in transformers) and
    `max_position_embeddings` (the fallback for it, and with it the fallback for a null factor)."""
    unknown = sorted(k for k in scaling if k not in YARN_KEYS)
    if unknown:
        known = ", ".join(sorted(YARN_KEYS))
        raise UnsupportedModelError(f"{source}: yarn rope scaling key {shown(unknown[0])} is not supported ({known})")
    original = _original_positions(scaling, args, source)
    factor = scaling.get("factor")
    if factor is None:
        factor = _positions(args, "max_position_embeddings", source) / original
    elif not (is_finite_number(factor) and factor > 0):
        raise ConfigError(f"{source}: rope scaling factor must be a positive number, got {shown(factor)}")
    truncate = scaling.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ConfigError(f"{source}: rope scaling truncate must be true or false, got {shown(truncate)}")
    resolved = {
        "type": "yarn",
        "rope_type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": original,
        # transformers reads these with `or`: null and 0 mean the paper's 32 and 1.
        "beta_fast": _positive(scaling, "beta_fast", source) or 32,
        "beta_slow": _positive(scaling, "beta_slow", source) or 1,
        "truncate": truncate,
        "attention_factor": _attention_factor(scaling, factor, source),
    }
    # DeepSeek-V3's attention reads mscale_all_dim again for its softmax scale (transformers and mlx-lm).
    resolved.update({key: scaling[key] for key in ("mscale", "mscale_all_dim") if scaling.get(key) is not None})
    return resolved


def yarn_inverse_frequencies(dims: int, base: float, yarn: dict[str, Any]) -> tuple[list[float], float]:
    """The blend of interpolated and extrapolated frequencies for `dims` rotated dimensions, and the
    factor cos and sin are scaled by. Float64 here; the caller rounds to float32 like torch's buffer."""
    if not base > 1:
        raise ConfigError(f"rope_theta must be above 1 for yarn rope scaling, got {shown(base)}")
    factor, original = yarn["factor"], yarn["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over `original`
        return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(yarn["beta_fast"]), correction_dim(yarn["beta_slow"])
    if yarn["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001  # transformers' guard against dividing by zero
    inverse = []
    for i in range(dims // 2):
        extrapolated = base ** -(2 * i / dims)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)  # 0: keep the original frequency, 1: interpolate
        inverse.append(extrapolated / factor * ramp + extrapolated * (1 - ramp))
    return inverse, yarn["attention_factor"]


def _original_positions(scaling: dict[str, Any], args: dict[str, Any], source: str) -> int:
    if "original_max_position_embeddings" in args:
        return _positions(args, "original_max_position_embeddings", source)
    if "original_max_position_embeddings" in scaling:
        return _positions(scaling, "original_max_position_embeddings", source, "rope scaling ")
    return _positions(args, "max_position_embeddings", source)


def _positions(values: dict[str, Any], key: str, source: str, where: str = "") -> int:
    value = values.get(key)
    if not (is_int(value) and 0 < value <= MAX_DIM):
        raise ConfigError(
            f"{source}: {where}{key} must be a positive integer for yarn rope scaling, got {shown(value)}"
        )
    return value


def _positive(scaling: dict[str, Any], key: str, source: str) -> float | None:
    value = scaling.get(key)
    if value is not None and not (is_finite_number(value) and value >= 0):
        raise ConfigError(f"{source}: rope scaling {key} must be a positive number, got {shown(value)}")
    return value


def _attention_factor(scaling: dict[str, Any], factor: float, source: str) -> float:
    """transformers' rule: an explicit attention_factor, else mscale / mscale_all_dim when both are set,
    else 0.1 * ln(factor) + 1."""
    explicit = scaling.get("attention_factor")
    if explicit is not None:
        if not (is_finite_number(explicit) and explicit > 0):
            raise ConfigError(
                f"{source}: rope scaling attention_factor must be a positive number, got {shown(explicit)}"
            )
        return float(explicit)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    for key, value in (("mscale", mscale), ("mscale_all_dim", mscale_all_dim)):
        if value is not None and not is_finite_number(value):
            raise ConfigError(f"{source}: rope scaling {key} must be a number, got {shown(value)}")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        if get_mscale(factor, mscale_all_dim) == 0:
            raise ConfigError(
                f"{source}: rope scaling mscale_all_dim={shown(mscale_all_dim)} makes the attention factor infinite"
            )
        return get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
    return get_mscale(factor)
