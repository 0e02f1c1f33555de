"""Gemma 2 (Gemma2ForCausalLM): even layers slide, attention logits soft-capped (which config.json must give)."""

from __future__ import annotations

from ..models.registry import GEMMA, ArchSpec

SPECS = {
    "gemma2": ArchSpec(
        "gemma2",
        sliding="alternate",
        rope_types=frozenset({"default"}),
        required=("attn_logit_softcapping",),
        folds_query_groups=True,  # mlx-lm's attention: scores (B, kv_heads, groups, L, T)
        float_kv_only=True,  # mlx-lm's attention soft-caps the scores itself, on float keys only
        hf_class="Gemma2ForCausalLM",
        **GEMMA,
    ),
}
