"""Qwen3 (Qwen3ForCausalLM): mlx-lm's qwen3 module (per-head q/k norms, Qwen's sliding rule); no biases.

Also Qwen3-VL's text model (qwen3_vl_text, the text half of qwen3_vl; see models/multimodal.py): Qwen3's layers
rotated by M-RoPE, whose image tokens take 2-D positions, and whose first layers add the tower's deepstack features
to the image tokens (models/decoder.py). Its image half is Qwen3.5's (families/qwen3_next.py), with deepstack.
Reference: transformers' modeling_qwen3_vl.py.
"""

from __future__ import annotations

from ..models.config import ModelConfig
from ..models.decoder import DecoderLM
from ..models.gguf_arch import GGUFArch
from ..models.registry import ArchSpec
from ..models.shared_layers import shared_mrope
from .qwen3_next import qwen_vision

QWEN3_VL_SECTIONS = (24, 20, 20)  # Qwen3VLTextConfig's mrope_section where rope_parameters names none


def adapt_vl(model: DecoderLM, config: ModelConfig) -> None:
    """Every attention layer rotates by the model's one M-RoPE."""
    for layer in model.layers:
        attn = layer.self_attn
        dims = config.args["head_dim"]
        attn.rope = shared_mrope(model, config.args, dims, config.source, QWEN3_VL_SECTIONS)


SPECS = {
    "qwen3": ArchSpec("qwen3", sliding="qwen", neutral={"attention_bias": False}, hf_class="Qwen3ForCausalLM"),
    "qwen3_vl_text": ArchSpec(
        "qwen3",
        neutral={"attention_bias": False},
        adapt=adapt_vl,
        mlx_lm_form=lambda config: {"model_type": "qwen3_vl"},  # mlx-lm's qwen3_vl reads a flat text config
    ),
}
# llama.cpp's "qwen3": only the keys and names every architecture shares.
GGUF = {"qwen3": GGUFArch("qwen3", (1e-6, 1_000_000.0))}
VISION = {"qwen3_vl": qwen_vision}
