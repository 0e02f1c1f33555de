"""Read a GGUF file as a Hugging Face-style config and weights.

gguf_file.py validates the header and turns Q4_0/Q4_1/Q8_0 tensors into MLX
affine quantized arrays (weight, scales, biases). What is left here: llama.cpp's
tensor names, its hyperparameter keys, and the row permutation its converter
applies to Q and K. See https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from ..errors import ConfigError, UnsupportedModelError
from .gguf_file import GGUFFile, QuantizedTensor

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, mx.array], dict[str, Any]]:
    """Return (config.json-style dict, HF-named weights, raw metadata)."""
    with GGUFFile(path) as gguf:
        config = gguf_config(gguf)
        weights: dict[str, mx.array] = {}
        for name in gguf.tensors:
            hf_name = hf_tensor_name(name)
            weights.update(to_mlx(hf_name, unpermute_rows(hf_name, gguf.read(name), config)))
        return config, weights, gguf.metadata


def gguf_config(gguf: GGUFFile) -> dict[str, Any]:
    """config.json-style dict of an open GGUF file; refuses architectures we cannot map."""
    arch = gguf.metadata.get("general.architecture")
    if arch != "llama":
        raise UnsupportedModelError(
            f"{gguf.path}: GGUF architecture {arch!r} is not supported yet (only 'llama'); "
            "use the model's Hugging Face checkpoint instead"
        )
    if "rope_freqs.weight" in gguf.tensors:
        raise UnsupportedModelError(
            f"{gguf.path}: this GGUF stores its RoPE scaling as a rope_freqs tensor (Llama 3.1 style), "
            "which is not supported yet; use the model's Hugging Face checkpoint"
        )
    return llama_config(gguf.path, gguf.metadata, has_output="output.weight" in gguf.tensors)


def to_mlx(hf_name: str, value: np.ndarray | QuantizedTensor) -> dict[str, mx.array]:
    """MLX arrays for one tensor read from GGUF: one float array or a quantized triplet."""
    if isinstance(value, QuantizedTensor):
        stem = hf_name.removesuffix(".weight")
        return {hf_name: mx.array(value.weight), f"{stem}.scales": mx.array(value.scales),
                f"{stem}.biases": mx.array(value.biases)}  # fmt: skip
    if value.dtype == np.uint16:  # bf16 bits
        return {hf_name: mx.array(value).view(mx.bfloat16)}
    return {hf_name: mx.array(value)}


def _meta_int(path: Path, metadata: dict[str, Any], key: str, default: int | None = None) -> int:
    value = metadata.get(key)
    if value is None:
        if default is None:
            raise ConfigError(f"{path}: GGUF metadata lacks {key!r}")
        return default
    return int(value.item() if hasattr(value, "item") else value)


def _meta_float(metadata: dict[str, Any], key: str, default: float) -> float:
    value = metadata.get(key)
    if value is None:
        return default
    return float(value.item() if hasattr(value, "item") else value)


def llama_config(path: Path, md: dict[str, Any], has_output: bool) -> dict[str, Any]:
    """A config.json-style dict from a llama GGUF's metadata."""
    hidden = _meta_int(path, md, "llama.embedding_length")
    heads = _meta_int(path, md, "llama.attention.head_count")
    tokens = md.get("tokenizer.ggml.tokens") or []
    rope_scaling = None
    scaling_type = md.get("llama.rope.scaling.type")
    if scaling_type not in (None, "none"):
        if scaling_type != "linear":
            raise UnsupportedModelError(f"{path}: GGUF rope scaling {scaling_type!r} is not supported")
        rope_scaling = {"type": "linear", "factor": _meta_float(md, "llama.rope.scaling.factor", 1.0)}
    config: dict[str, Any] = {
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": _meta_int(path, md, "llama.feed_forward_length"),
        "num_hidden_layers": _meta_int(path, md, "llama.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _meta_int(path, md, "llama.attention.head_count_kv", heads),
        "head_dim": _meta_int(path, md, "llama.rope.dimension_count", hidden // max(heads, 1)),
        "rms_norm_eps": _meta_float(md, "llama.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": _meta_float(md, "llama.rope.freq_base", 10000.0),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": _meta_int(path, md, "llama.context_length", 4096),
        "vocab_size": _meta_int(path, md, "llama.vocab_size", len(tokens)),
        "tie_word_embeddings": not has_output,
        "bos_token_id": _meta_int(path, md, "tokenizer.ggml.bos_token_id", -1),
        "eos_token_id": _meta_int(path, md, "tokenizer.ggml.eos_token_id", -1),
    }
    for key in ("bos_token_id", "eos_token_id"):
        if config[key] < 0:
            config[key] = None
    return config


def hf_tensor_name(name: str) -> str:
    """The Hugging Face name of a llama.cpp tensor (unknown names pass through, and fail verification)."""
    stem, _, kind = name.rpartition(".")  # kind: weight | scales | biases | bias
    if stem.startswith("blk."):
        _, index, part = stem.split(".", 2)
        mapped = _LAYER_NAMES.get(part)
        return f"model.layers.{index}.{mapped}.{kind}" if mapped else name
    mapped = _TOP_NAMES.get(stem)
    return f"{mapped}.{kind}" if mapped else name


def unpermute_rows(name: str, array: Any, config: dict[str, Any]) -> Any:
    """Undo llama.cpp's Q/K row order for one tensor (mx or numpy array); others pass through."""
    # llama.cpp's converter reorders Q and K rows from HF's "rotate half" layout to
    # interleaved pairs (permute(w, n_head): (n_head, 2, d/2, ...) -> (n_head, d/2, 2, ...)).
    # Without undoing it, RoPE rotates the wrong pairs and the text degrades within
    # a few tokens. Rows are the output features, so packed quantized weights,
    # scales and biases all permute the same way.
    if isinstance(array, QuantizedTensor):
        return QuantizedTensor(
            *(unpermute_rows(name, a, config) for a in (array.weight, array.scales, array.biases)),
            array.bits,
            array.group_size,
        )
    if ".self_attn.q_proj." in name:
        heads = config["num_attention_heads"]
    elif ".self_attn.k_proj." in name:
        heads = config["num_key_value_heads"]
    else:
        return array
    rows = array.shape[0]
    split = array.reshape(heads, rows // heads // 2, 2, *array.shape[1:])
    return split.swapaxes(1, 2).reshape(array.shape)
