"""Llama (LlamaForCausalLM) and Mistral (MistralForCausalLM, llama blocks whose every layer slides when
sliding_window is set): mlx-lm's llama module computes what transformers does for both; no adapter. Their GGUF
files (llama.cpp writes both as "llama") store Q/K rows permuted, which models/gguf.py undoes."""

from __future__ import annotations

from typing import Any

from ..models.gguf_arch import GGUFArch, Meta
from ..models.registry import ArchSpec


def gguf_config(meta: Meta) -> dict[str, Any]:
    heads, hidden = meta.int("attention.head_count"), meta.int("embedding_length")
    out: dict[str, Any] = {"head_dim": meta.int("rope.dimension_count", hidden // heads)}
    # Llama's biases are switched on by config flags, which GGUF has no key for: the tensors tell.
    out["attention_bias"] = "blk.0.attn_q.bias" in meta.tensors
    out["mlp_bias"] = "blk.0.ffn_down.bias" in meta.tensors
    window = meta.int("attention.sliding_window", None)
    if window is not None:  # a Mistral that keeps its window: transformers' mistral applies it, llama would not
        out.update(model_type="mistral", sliding_window=window)
    return out


GGUF = {"llama": GGUFArch("llama", (1e-5, 10_000.0), gguf_config, permutes_qk=True)}


SPECS = {
    "llama": ArchSpec("llama", neutral={"pretraining_tp": 1}, hf_class="LlamaForCausalLM"),
    "mistral": ArchSpec("llama", sliding="all", hf_class="MistralForCausalLM"),
}
