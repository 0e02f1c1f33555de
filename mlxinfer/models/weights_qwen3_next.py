"""Qwen3-Next / Qwen3.5 tensors in transformers' layout -> mlx-lm's parameters.

Three differences (transformers' modeling_qwen3_next.py vs mlx-lm's qwen3_next.py):
per-expert matrices are stacked into one (experts, out, in) tensor per projection; the
depthwise conv weight (channels, 1, kernel) becomes (channels, kernel, 1); and the
zero-centred RMSNorms (stored w, applied as 1 + w) store 1 + w, since mlx-lm applies
its weight as is. The gated norm inside linear attention stores its scale and stays.
A checkpoint already in mlx-lm's layout (an MLX conversion) passes through unchanged.
"""

from __future__ import annotations

import re
from collections import defaultdict

import mlx.core as mx

from ..errors import WeightMismatchError
from ..untrusted import listed

_EXPERT = re.compile(r"(.+\.mlp)\.experts\.(0|[1-9][0-9]{0,8})\.(gate_proj|up_proj|down_proj)\.weight")
_ZERO_CENTRED = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".self_attn.q_norm.weight",
                 ".self_attn.k_norm.weight")  # fmt: skip
_FINAL_NORM = "model.norm.weight"


def to_mlx_layout(weights: dict[str, mx.array], num_experts: int) -> dict[str, mx.array]:
    """`weights` with experts stacked, conv weights transposed and zero-centred norms shifted by one.

    Multi-token-prediction tensors (`mtp.*`, a draft head the decoder does not run) are dropped."""
    weights = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
    if is_mlx_layout(weights):
        return weights
    weights = _stack_experts(weights, num_experts)
    for name, value in weights.items():
        if name.endswith(".linear_attn.conv1d.weight") and value.ndim == 3:
            weights[name] = value.swapaxes(1, 2)  # (C, 1, K) -> (C, K, 1)
        elif (name == _FINAL_NORM or name.endswith(_ZERO_CENTRED)) and value.ndim == 1:
            weights[name] = value + 1.0
    return weights


def is_mlx_layout(weights: dict[str, mx.array]) -> bool:
    """Whether an MLX conversion wrote `weights` (its conv kernels lie on axis 1; kernel size is at least 2)."""
    convs = [v for k, v in weights.items() if k.endswith(".linear_attn.conv1d.weight") and v.ndim == 3]
    if convs:
        return convs[0].shape[1] != 1
    return any(".mlp.switch_mlp." in k for k in weights)


def _stack_experts(weights: dict[str, mx.array], num_experts: int) -> dict[str, mx.array]:
    groups: dict[tuple[str, str], dict[int, str]] = defaultdict(dict)
    for name in weights:
        if m := _EXPERT.fullmatch(name):
            groups[m.group(1), m.group(3)][int(m.group(2))] = name
    wrong = [f"{mlp}.experts.*.{proj} ({len(found)} of {num_experts})" for (mlp, proj), found in groups.items()
             if sorted(found) != list(range(num_experts))]  # fmt: skip
    if wrong:
        raise WeightMismatchError(f"expected experts 0 to {num_experts - 1} in each of {listed(sorted(wrong))}")
    for (mlp, proj), found in groups.items():
        weights[f"{mlp}.switch_mlp.{proj}.weight"] = mx.stack([weights.pop(found[e]) for e in range(num_experts)])
    return weights
