"""gpt-oss expert tensors, from the layout transformers saves to the one mlx-lm's SwitchGLU holds.

transformers (GptOssExperts) keeps each layer's experts fused and stored (in, out):
    gate_up_proj (E, hidden, 2I), gate and up interleaved on the last axis, + gate_up_proj_bias (E, 2I)
    down_proj    (E, I, hidden) + down_proj_bias (E, hidden)
mlx-lm wants experts.{gate,up,down}_proj.{weight,bias}, weights stored (E, out, in). mlx-lm's own sanitize
only knows the MXFP4 layout of the Hub checkpoints (`*_blocks`, `*_scales`, split on another axis); applied
to this one it slices the wrong axis. Folders already in mlx-lm's layout (mlxinfer or mlx-lm output) pass.
"""

from __future__ import annotations

import mlx.core as mx

from ..errors import UnsupportedModelError, WeightMismatchError
from ..untrusted import listed
from .config import ModelConfig

_FUSED = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def convert_gpt_oss_weights(weights: dict[str, mx.array], config: ModelConfig) -> dict[str, mx.array]:
    """`weights` with every layer's fused expert tensors split into mlx-lm's names and shapes."""
    mxfp4 = sorted(k for k in weights if k.endswith(("_blocks", "_scales")) and ".experts." in k)
    if mxfp4:
        raise UnsupportedModelError(
            f"{config.source}: MXFP4-quantized experts ({listed(mxfp4, limit=2)}) are not supported; "
            "convert from a bf16 checkpoint of this model (e.g. one saved by transformers with dequantize=True)"
        )
    out: dict[str, mx.array] = {}
    for name, value in weights.items():
        prefix, found, leaf = name.rpartition(".experts.")
        if not found or leaf not in _FUSED:
            out[name] = value
            continue
        _check_shape(name, value, _expected(leaf, config))
        experts = f"{prefix}.experts"
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


def _expected(leaf: str, config: ModelConfig) -> tuple[int, ...]:
    a = config.args
    experts, hidden, inner = int(a["num_local_experts"]), config.hidden_size, int(a["intermediate_size"])
    return {
        "gate_up_proj": (experts, hidden, 2 * inner),
        "gate_up_proj_bias": (experts, 2 * inner),
        "down_proj": (experts, inner, hidden),
        "down_proj_bias": (experts, hidden),
    }[leaf]


def _check_shape(name: str, value: mx.array, expected: tuple[int, ...]) -> None:
    # The split axis depends on the layout: a tensor stored the other way round must not be cut wrongly.
    if tuple(value.shape) != expected:
        raise WeightMismatchError(
            f"{name}: shape {tuple(value.shape)}, expected {expected} (transformers' layout: experts, in, out)"
        )
