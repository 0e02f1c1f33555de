"""GLM-4-0414 (Glm4ForCausalLM): interleaved partial RoPE (mlx-lm's rope_traditional defaults to true), no RoPE
scaling; mlx-lm's glm4 module computes what transformers does."""

from __future__ import annotations

from ..models.registry import ArchSpec

SPECS = {
    "glm4": ArchSpec(
        "glm4",
        rope_types=frozenset({"default"}),
        partial_rotary=True,
        defaults={  # Glm4Config's, where mlx-lm's differ or it has none
            "head_dim": 128,
            "num_key_value_heads": 2,
            "attention_bias": True,
            "partial_rotary_factor": 0.5,
            "rope_theta": 10000.0,
            "rms_norm_eps": 1.5625e-07,
            "max_position_embeddings": 131072,
        },
    ),
}
