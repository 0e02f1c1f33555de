"""LFM2 (Lfm2ForCausalLM): attention layers between short-convolution ones, each conv layer a fixed-size state.

mlx-lm's module computes what transformers does; its sanitize brings the conv weights into MLX's layout."""

from __future__ import annotations

from ..models.registry import ArchSpec

SPECS = {
    "lfm2": ArchSpec(
        "lfm2",
        activation_keys=(),
        sliding="declared",
        recurrent_kinds=frozenset({"conv"}),
        final_norm="embedding_norm",
        renamed={"block_dim": "hidden_size"},
        mlx_sanitize=True,
        tied_by_default=True,
        neutral={"conv_bias": False},
        hf_class="Lfm2ForCausalLM",
    ),
}
