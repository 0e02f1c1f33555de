"""Granite 3 MoE on mlx-lm's layers, made to compute what transformers' GraniteMoeForCausalLM does.

Our forward (models/decoder.py) runs mlx-lm's blocks but not its backbone's or head's `__call__`, so the
two scalings those apply are set here, as for Granite 4.0 hybrid: embeddings times `embedding_multiplier`,
logits divided by `logits_scaling`. The fused expert tensors are split by models/moe_weights.py.
"""

from __future__ import annotations

from dataclasses import replace

from .config import ModelConfig
from .decoder import DecoderLM
from .granitemoehybrid_layers import ScaledRMSNorm
from .moe_layers import expert_sanitizer
from .moe_weights import GRANITE


def adapt(model: DecoderLM, config: ModelConfig) -> None:
    args = config.args
    model.layout = replace(model.layout, embed_scale=float(args["embedding_multiplier"]))
    model.model.norm = ScaledRMSNorm(config.hidden_size, args["rms_norm_eps"], 1 / args["logits_scaling"])
    expert_sanitizer(model, config, GRANITE)
