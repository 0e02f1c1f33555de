"""Phi-3 / Phi-4 (Phi3ForCausalLM): fused qkv and gate_up projections, partial RoPE, plain RoPE only (LongRoPE
is refused)."""

from __future__ import annotations

from typing import Any

from ..errors import UnsupportedModelError
from ..models.gguf_arch import GGUFArch, Meta
from ..models.registry import ArchSpec

SPECS = {
    "phi3": ArchSpec(
        "phi3",
        sliding="all",
        fixed_head_dim=True,
        rope_types=frozenset({"default"}),
        partial_rotary=True,
        hf_class="Phi3ForCausalLM",
    ),
}


def gguf_config(meta: Meta) -> dict[str, Any]:
    if "rope_factors_long.weight" in meta.tensors or "rope_factors_short.weight" in meta.tensors:
        raise UnsupportedModelError(
            f"{meta.path}: this phi3 GGUF stores LongRoPE factors (rope_factors_long/short), which are not "
            "supported; use a 4k-context Phi-3 or the model's Hugging Face checkpoint"
        )
    hidden, heads = meta.int("embedding_length"), meta.int("attention.head_count")
    head_dim = hidden // heads
    rotary = meta.int("rope.dimension_count", head_dim)  # int(partial_rotary_factor * head_dim)
    out: dict[str, Any] = {"head_dim": head_dim, "partial_rotary_factor": rotary / head_dim}
    # Phi3MiniModel writes 0 for "no window" (Phi-4 and configs with sliding_window null).
    out["sliding_window"] = meta.int("attention.sliding_window", 0, low=0) or None
    original = meta.int("rope.scaling.original_context_length", None)
    if original is not None:
        out["original_max_position_embeddings"] = original
    return out


GGUF = {
    "phi3": GGUFArch(
        "phi3",
        (1e-5, 10_000.0),
        gguf_config,
        names={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    ),
}
