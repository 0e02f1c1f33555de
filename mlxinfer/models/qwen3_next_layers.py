"""Make mlx-lm's freshly built Qwen3-Next / Qwen3.5 layers compute what transformers does.

Each layer's block must be the one layer_types names (config normalization rewrote
mlx-lm's full_attention_interval to say so; checked here). mlx-lm's qwen3_5 reads
RoPE from rope_parameters with its own defaults (theta 1e5 when the key is absent),
so every attention layer gets the RoPE of the normalized config. The checkpoint's
tensors go through weights_qwen3_next.to_mlx_layout.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from ..errors import UnsupportedModelError
from .mlx_lm_modules import model_module
from .qwen3_next_config import LINEAR
from .weights_qwen3_next import to_mlx_layout

if TYPE_CHECKING:
    from .config import ModelConfig
    from .decoder import DecoderLM


def adapt(model: DecoderLM, config: ModelConfig) -> None:
    """Check each layer's block, set its RoPE, and convert the checkpoint's layout when it loads."""
    args = config.args
    initialize_rope = model_module("rope_utils").initialize_rope
    for i, (layer, kind) in enumerate(zip(model.layers, config.layer_types)):
        if layer.is_linear != (kind == LINEAR):
            built = "linear attention" if layer.is_linear else "full attention"
            raise UnsupportedModelError(f"{config.source}: layer {i} was built as {built}; layer_types says {kind}")
        if not layer.is_linear:
            attn = layer.self_attn
            attn.rope = initialize_rope(
                int(attn.head_dim * args["partial_rotary_factor"]),
                base=args["rope_theta"],
                traditional=False,
                scaling_config=args.get("rope_scaling"),
                max_position_embeddings=args.get("max_position_embeddings"),
            )
    model.mlx_sanitize = partial(to_mlx_layout, num_experts=int(args.get("num_experts") or 0))
