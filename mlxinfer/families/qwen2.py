"""Qwen2 (Qwen2ForCausalLM): mlx-lm's qwen2 module; the window applies from max_window_layers on (the "qwen"
rule in config.py), and mlx-lm derives head_dim from hidden_size."""

from __future__ import annotations

from ..models.gguf_arch import GGUFArch
from ..models.registry import ArchSpec

SPECS = {"qwen2": ArchSpec("qwen2", sliding="qwen", fixed_head_dim=True, hf_class="Qwen2ForCausalLM")}
# llama.cpp's "qwen2": only the keys and names every architecture shares.
GGUF = {"qwen2": GGUFArch("qwen2", (1e-6, 1_000_000.0))}
