"""Qwen3-MoE, Mixtral and OLMoE on mlx-lm's layers: their blocks compute what transformers' do, only the
checkpoint's expert tensors need mlx-lm's stacked layout (models/moe_weights.py)."""

from __future__ import annotations

from functools import partial

from .config import ModelConfig
from .decoder import DecoderLM
from .moe_weights import MIXTRAL, QWEN, ExpertLayout, to_switch_layout

_LAYOUTS: dict[str, ExpertLayout] = {"qwen3_moe": QWEN, "olmoe": QWEN, "mixtral": MIXTRAL}


def adapt(model: DecoderLM, config: ModelConfig) -> None:
    expert_sanitizer(model, config, _LAYOUTS[config.model_type])


def expert_sanitizer(model: DecoderLM, config: ModelConfig, layout: ExpertLayout) -> None:
    """Make the loader and the converter bring `layout`'s expert tensors into mlx-lm's layout."""
    experts = int(config.args[layout.count_key])
    model.mlx_sanitize = partial(to_switch_layout, layout=layout, num_experts=experts, source=config.source)
