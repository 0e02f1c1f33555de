"""Qwen3 (Qwen3ForCausalLM): mlx-lm's qwen3 module (per-head q/k norms, Qwen's sliding rule); no biases."""

from __future__ import annotations

from ..models.gguf_arch import GGUFArch
from ..models.registry import ArchSpec

SPECS = {"qwen3": ArchSpec("qwen3", sliding="qwen", neutral={"attention_bias": False}, hf_class="Qwen3ForCausalLM")}
# llama.cpp's "qwen3": only the keys and names every architecture shares.
GGUF = {"qwen3": GGUFArch("qwen3", (1e-6, 1_000_000.0))}
