"""Expert tensors of the MoE families, from the layouts transformers saves to the one mlx-lm's SwitchGLU holds.

mlx-lm wants each MoE layer's experts stacked per projection: `<block>.switch_mlp.{gate,up,down}_proj.weight`,
(experts, out, in). The checkpoints hold them as
- one tensor per expert and projection (Qwen3-MoE, OLMoE, Qwen3.5-MoE: `mlp.experts.N.gate_proj.weight`;
  Mixtral: `block_sparse_moe.experts.N.w1.weight`, w1/w3/w2 = gate/up/down), or
- fused, gate and up halves on axis 1 (Qwen3.5-MoE Hub checkpoints: `mlp.experts.gate_up_proj` (E, 2I, H) and
  `mlp.experts.down_proj` (E, H, I); Granite: `block_sparse_moe.input_linear.weight` / `output_linear.weight`).
mlx-lm's own `sanitize` assumes a complete checkpoint (a KeyError otherwise); here each expert count and each
router is checked against config.json first, with one line naming both. Folders already in mlx-lm's layout
(mlxinfer or mlx-lm output) pass unchanged. Only shapes are read: the converter runs this on lazy arrays.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import mlx.core as mx

from ..errors import WeightMismatchError
from ..untrusted import plain

if TYPE_CHECKING:
    from .config import ModelConfig
    from .decoder import DecoderLM


@dataclass(frozen=True)
class ExpertLayout:
    """Where one family keeps its experts and router, and what config.json calls their number."""

    block: str  # the MoE block under each layer: "mlp" or "block_sparse_moe"
    router: str  # the router's weight under the block, one row per expert
    count_key: str  # num_experts / num_local_experts
    # Per-expert projection names -> mlx-lm's (Mixtral's w1/w3/w2).
    names: tuple[tuple[str, str], ...] = (
        ("gate_proj", "gate_proj"),
        ("up_proj", "up_proj"),
        ("down_proj", "down_proj"),
    )
    # Fused tensors under the block: (gate and up on axis 1, down).
    fused: tuple[str, str] | None = None


# Qwen3-MoE, OLMoE and Qwen3.5-MoE (mlxinfer/families/mixtral.py and granitemoe.py hold their own layouts).
QWEN = ExpertLayout("mlp", "gate.weight", "num_experts", fused=("experts.gate_up_proj", "experts.down_proj"))
_LAYER_BLOCK = r"(model\.layers\.(?:0|[1-9][0-9]{0,8})\.%s)"


def expert_sanitizer(model: DecoderLM, config: ModelConfig, layout: ExpertLayout) -> None:
    """Make the loader and the converter bring `layout`'s expert tensors into mlx-lm's layout (the adapter of
    the MoE families whose blocks mlx-lm computes as transformers does)."""
    experts = int(config.args[layout.count_key])
    model.mlx_sanitize = partial(to_switch_layout, layout=layout, num_experts=experts, source=config.source)


def to_switch_layout(
    weights: dict[str, mx.array], layout: ExpertLayout, num_experts: int, source: str
) -> dict[str, mx.array]:
    """`weights` with every MoE layer's experts stacked (or split) into mlx-lm's switch_mlp tensors."""
    _check_routers(weights, layout, num_experts, source)
    weights = _stack(weights, layout, num_experts, source)
    if layout.fused is not None:
        weights = _split_fused(weights, layout, num_experts, source)
    return weights


def _check_routers(weights: dict[str, mx.array], layout: ExpertLayout, num_experts: int, source: str) -> None:
    router = re.compile(_LAYER_BLOCK % re.escape(layout.block) + re.escape(f".{layout.router}"))
    for name, value in weights.items():
        if router.fullmatch(name) and (value.ndim != 2 or value.shape[0] != num_experts):
            raise WeightMismatchError(
                f"{source}: {layout.count_key} is {num_experts} but the router {plain(name)} has shape "
                f"{tuple(value.shape)} (one row per expert); the config does not describe these weights"
            )


def _stack(weights: dict[str, mx.array], layout: ExpertLayout, num_experts: int, source: str) -> dict[str, mx.array]:
    names = dict(layout.names)
    expert = re.compile(
        _LAYER_BLOCK % re.escape(layout.block)
        + r"\.experts\.(0|[1-9][0-9]{0,8})\.("
        + "|".join(map(re.escape, names))
        + r")\.weight"
    )
    groups: dict[tuple[str, str], dict[int, str]] = defaultdict(dict)
    for name in weights:
        if m := expert.fullmatch(name):
            groups[m.group(1), m.group(3)][int(m.group(2))] = name
    for (block, proj), found in sorted(groups.items()):
        if sorted(found) != list(range(num_experts)):
            held = f"experts {min(found)} to {max(found)} ({len(found)} in all)"
            raise WeightMismatchError(
                f"{source}: {layout.count_key} is {num_experts} but {plain(block)}.experts.*.{proj} holds {held}; "
                "the config does not describe these weights"
            )
    out = dict(weights)
    for (block, proj), found in groups.items():
        out[f"{block}.switch_mlp.{names[proj]}.weight"] = mx.stack([out.pop(found[e]) for e in range(num_experts)])
    return out


def _split_fused(
    weights: dict[str, mx.array], layout: ExpertLayout, num_experts: int, source: str
) -> dict[str, mx.array]:
    gate_up, down = layout.fused
    fused = re.compile(
        _LAYER_BLOCK % re.escape(layout.block) + r"\.(" + re.escape(gate_up) + "|" + re.escape(down) + ")"
    )
    out: dict[str, mx.array] = {}
    for name, value in weights.items():
        m = fused.fullmatch(name)
        if m is None:
            out[name] = value
            continue
        if value.ndim != 3 or value.shape[0] != num_experts or (m.group(2) == gate_up and value.shape[1] % 2):
            what = "(experts, 2 * intermediate, hidden)" if m.group(2) == gate_up else "(experts, hidden, intermediate)"
            raise WeightMismatchError(
                f"{source}: {layout.count_key} is {num_experts} but {plain(name)} has shape {tuple(value.shape)}, "
                f"expected {what}; the config does not describe these weights"
            )
        switch = f"{m.group(1)}.switch_mlp"
        if m.group(2) == gate_up:  # (E, 2I, H): the gate's rows, then the up projection's
            half = value.shape[1] // 2
            out[f"{switch}.gate_proj.weight"] = value[:, :half]
            out[f"{switch}.up_proj.weight"] = value[:, half:]
        else:
            out[f"{switch}.down_proj.weight"] = value
    return out
