"""Gemma 2 (Gemma2ForCausalLM): even layers slide, attention logits soft-capped (which config.json must give)."""

from __future__ import annotations

from ..models.registry import GEMMA, ArchSpec

SPECS = {
    "gemma2": ArchSpec(
        "gemma2",
        sliding="alternate",
        rope_types=frozenset({"default"}),
        required=("attn_logit_softcapping",),
        **GEMMA,
    ),
}
