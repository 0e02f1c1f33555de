"""gpt-oss expert tensors, from the layout transformers saves to the one mlx-lm's SwitchGLU holds.

transformers (GptOssExperts) keeps each layer's experts fused and stored (in, out):
    gate_up_proj (E, hidden, 2I), gate and up interleaved on the last axis, + gate_up_proj_bias (E, 2I)
    down_proj    (E, I, hidden) + down_proj_bias (E, hidden)
mlx-lm wants experts.{gate,up,down}_proj.{weight,bias}, weights stored (E, out, in). mlx-lm's own sanitize
only knows the MXFP4 layout of the Hub checkpoints; applied to this one it slices the wrong axis. That layout,
stored (out, in) with gate and up interleaved on the rows, is kept as MLX mxfp4 (as mlx-lm's sanitize does):
    gate_up_proj_blocks (E, 2I, H/32, 16) uint8 + gate_up_proj_scales (E, 2I, H/32) uint8 (E8M0 exponents)
    down_proj_blocks    (E, H, I/32, 16)        + down_proj_scales    (E, H, I/32)
Each 16-byte block holds 32 E2M1 codes, element 2j in the low nibble of byte j: read as little-endian uint32
words, that is MLX's mxfp4 packing, and the exponents are its scales. Folders already in mlx-lm's layout
(mlxinfer or mlx-lm output) pass.
"""

from __future__ import annotations

import mlx.core as mx

from ..errors import WeightMismatchError
from .config import ModelConfig

_FUSED = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
_MXFP4 = ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")


def convert_gpt_oss_weights(weights: dict[str, mx.array], config: ModelConfig) -> dict[str, mx.array]:
    """`weights` with every layer's fused expert tensors split into mlx-lm's names and shapes."""
    out: dict[str, mx.array] = {}
    for name, value in weights.items():
        prefix, found, leaf = name.rpartition(".experts.")
        if not found or leaf not in _FUSED + _MXFP4:
            out[name] = value
            continue
        _check_shape(name, value, _expected(leaf, config))
        experts = f"{prefix}.experts"
        if leaf in _MXFP4:
            out.update(_mxfp4_experts(experts, leaf, value, name))
            continue
        if leaf == "gate_up_proj":  # (E, H, 2I) -> gate, up (E, I, H)
            out[f"{experts}.gate_proj.weight"] = mx.contiguous(value[..., ::2].swapaxes(1, 2))
            out[f"{experts}.up_proj.weight"] = mx.contiguous(value[..., 1::2].swapaxes(1, 2))
        elif leaf == "gate_up_proj_bias":  # (E, 2I) -> (E, I) each
            out[f"{experts}.gate_proj.bias"] = mx.contiguous(value[..., ::2])
            out[f"{experts}.up_proj.bias"] = mx.contiguous(value[..., 1::2])
        elif leaf == "down_proj":  # (E, I, H) -> (E, H, I)
            out[f"{experts}.down_proj.weight"] = mx.contiguous(value.swapaxes(1, 2))
        else:
            out[f"{experts}.down_proj.bias"] = value
    return out


def _mxfp4_experts(experts: str, leaf: str, value: mx.array, name: str) -> dict[str, mx.array]:
    """One Hub MXFP4 tensor as mlx-lm's packed weight or scales: gate and up are the even and odd rows."""
    if value.dtype != mx.uint8:
        raise WeightMismatchError(f"{name}: dtype {value.dtype}, expected uint8 (MXFP4 blocks and exponents)")
    fused, _, part = leaf.rpartition("_")  # gate_up_proj | down_proj, blocks | scales
    if part == "blocks":  # (E, out, in/32, 16) bytes -> (E, out, in/8) words
        value = value.view(mx.uint32).flatten(-2)
    kind = "weight" if part == "blocks" else "scales"
    if fused == "down_proj":
        return {f"{experts}.down_proj.{kind}": value}
    return {
        f"{experts}.gate_proj.{kind}": mx.contiguous(value[:, ::2]),
        f"{experts}.up_proj.{kind}": mx.contiguous(value[:, 1::2]),
    }


def _expected(leaf: str, config: ModelConfig) -> tuple[int, ...]:
    a = config.args
    experts, hidden, inner = int(a["num_local_experts"]), config.hidden_size, int(a["intermediate_size"])
    return {
        "gate_up_proj": (experts, hidden, 2 * inner),
        "gate_up_proj_bias": (experts, 2 * inner),
        "down_proj": (experts, inner, hidden),
        "down_proj_bias": (experts, hidden),
        # MXFP4 (Hub): (experts, out, in / 32 blocks, 16 bytes) and one exponent per block.
        "gate_up_proj_blocks": (experts, 2 * inner, hidden // 32, 16),
        "gate_up_proj_scales": (experts, 2 * inner, hidden // 32),
        "down_proj_blocks": (experts, hidden, inner // 32, 16),
        "down_proj_scales": (experts, hidden, inner // 32),
    }[leaf]


def _check_shape(name: str, value: mx.array, expected: tuple[int, ...]) -> None:
    # The split axis depends on the layout: a tensor stored the other way round must not be cut wrongly.
    if tuple(value.shape) != expected:
        layout = {"_blocks": "experts, out, in / 32, 16 bytes", "_scales": "experts, out, in / 32"}.get(
            name[name.rfind("_") :], "experts, in, out"
        )
        raise WeightMismatchError(
            f"{name}: shape {tuple(value.shape)}, expected {expected} (transformers' layout: {layout})"
        )
