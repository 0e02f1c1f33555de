"""Qwen3.5-MoE on mlx-lm's qwen3_5 layers: Qwen3.5's adaptation (models/qwen3_next_layers.py), and the
experts of either layout (per expert, or fused as the Hub checkpoints store them) stacked for mlx-lm."""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

from . import qwen3_next_layers
from .moe_weights import QWEN, to_switch_layout

if TYPE_CHECKING:
    from collections.abc import Callable

    from .config import ModelConfig
    from .decoder import DecoderLM


def adapt(model: DecoderLM, config: ModelConfig) -> None:
    qwen3_next_layers.adapt(model, config)
    model.mlx_sanitize = _then_split_fused(model.mlx_sanitize, int(config.args["num_experts"]), config.source)


def _then_split_fused(
    qwen_layout: Callable[[dict[str, mx.array]], dict[str, mx.array]], experts: int, source: str
) -> Callable[[dict[str, mx.array]], dict[str, mx.array]]:
    # Qwen's conversion first (it decides from the conv kernels whether the folder is already in MLX's layout,
    # and shifts the norms); it stacks per-expert tensors and leaves fused ones for to_switch_layout.
    def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return to_switch_layout(qwen_layout(weights), QWEN, experts, source)

    return sanitize
