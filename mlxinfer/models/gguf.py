"""Read a GGUF file as a Hugging Face-style config and weights.

gguf_file.py validates the header and turns Q4_0/Q4_1/Q8_0 tensors into MLX
affine quantized arrays (weight, scales, biases). What is left here: llama.cpp's
tensor names, its hyperparameter keys, and the row permutation its converter
applies to Q and K. See https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from ..errors import ConfigError, CorruptFileError, UnsupportedModelError, WeightMismatchError
from ..untrusted import is_finite_number, is_int, plain, shown
from .config import MAX_LAYERS
from .gguf_file import REPACKED, GGUFFile, QuantizedTensor, TensorInfo
from .safetensors_header import MAX_DIM
from .sizing import StoredTensor

log = logging.getLogger(__name__)

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
        return config, gguf_weights(gguf, config), gguf.metadata


def gguf_weights(gguf: GGUFFile, config: dict[str, Any]) -> dict[str, mx.array]:
    """Every tensor of an open GGUF file as MLX arrays under its Hugging Face name."""
    weights: dict[str, mx.array] = {}
    for hf_name, name in hf_names(gguf).items():
        try:
            weights.update(to_mlx(hf_name, unpermute_rows(hf_name, gguf.read(name), config)))
        except WeightMismatchError as e:
            raise WeightMismatchError(f"{gguf.path}: {e}") from None
    return weights


def gguf_tensors(gguf: GGUFFile, compute_size: int) -> dict[str, StoredTensor]:
    """Each tensor's logical shape and its bytes once loaded (Q4/Q8 stay packed, other types become floats)."""

    def stored(info: TensorInfo) -> StoredTensor:
        floating = info.ggml_type not in REPACKED
        return StoredTensor(info.shape, math.prod(info.shape) * compute_size if floating else info.nbytes)

    return {hf: stored(gguf.tensors[name]) for hf, name in hf_names(gguf).items()}


def hf_names(gguf: GGUFFile) -> dict[str, str]:
    """Hugging Face name -> GGUF name; two tensors that would land on one name are refused."""
    names: dict[str, str] = {}
    claimed: dict[str, str] = {}
    for name, info in gguf.tensors.items():
        hf_name = hf_tensor_name(name)
        stem = hf_name.removesuffix(".weight")
        # A Q4/Q8 weight also brings its scales and biases (see to_mlx).
        extra = (f"{stem}.scales", f"{stem}.biases") if info.ggml_type in REPACKED else ()
        for key in (hf_name, *extra):
            if key in claimed:
                raise CorruptFileError(
                    f"{gguf.path}: tensors {plain(claimed[key])} and {plain(name)} both map to {plain(key)}"
                )
            claimed[key] = name
        names[hf_name] = name
    return names


def gguf_config(gguf: GGUFFile) -> dict[str, Any]:
    """config.json-style dict of an open GGUF file; refuses architectures we cannot map."""
    arch = gguf.metadata.get("general.architecture")
    if arch != "llama":
        raise UnsupportedModelError(
            f"{gguf.path}: GGUF general.architecture={shown(arch)} is not supported yet (only 'llama'); "
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


_REQUIRED: Any = object()


def _meta_int(
    path: Path, md: dict[str, Any], key: str, default: Any = _REQUIRED, low: int = 1, high: int = MAX_DIM
) -> Any:
    """An integer metadata value in [low, high]; `default` when absent (required when not given)."""
    value = md.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ConfigError(f"{path}: GGUF metadata lacks {key!r}; the file is incomplete")
        return default
    if not is_int(value) or not low <= value <= high:
        raise ConfigError(f"{path}: GGUF metadata {key!r} must be an integer from {low} to {high}, got {shown(value)}")
    return int(value)  # a plain int, should a reader hand in a numpy scalar


def _meta_float(path: Path, md: dict[str, Any], key: str, default: float) -> float:
    """A positive, finite number (every float we read is a base, an epsilon or a factor)."""
    value = md.get(key)
    if value is None:
        return default
    if not is_finite_number(value) or value <= 0:
        raise ConfigError(f"{path}: GGUF metadata {key!r} must be a positive finite number, got {shown(value)}")
    return float(value)


def llama_config(path: Path, md: dict[str, Any], has_output: bool) -> dict[str, Any]:
    """A config.json-style dict from a llama GGUF's metadata; normalize_config checks how the values fit together."""
    hidden = _meta_int(path, md, "llama.embedding_length")
    heads = _meta_int(path, md, "llama.attention.head_count")
    tokens = md.get("tokenizer.ggml.tokens", [])
    if not isinstance(tokens, list):
        raise ConfigError(f"{path}: GGUF metadata 'tokenizer.ggml.tokens' must be a list, got {shown(tokens)}")
    vocab = _meta_int(path, md, "llama.vocab_size", len(tokens) if tokens else _REQUIRED)
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": _meta_int(path, md, "llama.feed_forward_length"),
        "num_hidden_layers": _meta_int(path, md, "llama.block_count", high=MAX_LAYERS),
        "num_attention_heads": heads,
        "num_key_value_heads": _meta_int(path, md, "llama.attention.head_count_kv", heads),
        "head_dim": _meta_int(path, md, "llama.rope.dimension_count", hidden // heads),
        "rms_norm_eps": _meta_float(path, md, "llama.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": _meta_float(path, md, "llama.rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(path, md),
        "max_position_embeddings": _meta_int(path, md, "llama.context_length", 4096),
        "vocab_size": vocab,
        "tie_word_embeddings": not has_output,
        # An id outside the vocabulary is refused here, by its GGUF key (llama.cpp writes none for "no token"),
        # but for a BOS the model never adds: llama.cpp then ignores it, and so do we (see tokenizer/gguf_vocab.py).
        "bos_token_id": _bos_token_id(path, md, vocab),
        "eos_token_id": _meta_int(path, md, "tokenizer.ggml.eos_token_id", None, low=0, high=vocab - 1),
    }


def _bos_token_id(path: Path, md: dict[str, Any], vocab: int) -> int | None:
    key = "tokenizer.ggml.bos_token_id"
    value = md.get(key)
    if is_int(value) and not 0 <= value < vocab and md.get("tokenizer.ggml.add_bos_token") in (None, False, 0):
        log.warning(
            "%s: GGUF metadata %r is %s, outside the vocabulary, and never added; ignored", path, key, shown(value)
        )
        return None
    return _meta_int(path, md, key, None, low=0, high=vocab - 1)


def _rope_scaling(path: Path, md: dict[str, Any]) -> dict[str, Any] | None:
    kind = md.get("llama.rope.scaling.type")
    if kind is None or kind == "none":
        return None
    if kind != "linear":
        raise UnsupportedModelError(
            f"{path}: GGUF llama.rope.scaling.type={shown(kind)} is not supported (only 'linear')"
        )
    return {"type": "linear", "factor": _meta_float(path, md, "llama.rope.scaling.factor", 1.0)}


def hf_tensor_name(name: str) -> str:
    """The Hugging Face name of a llama.cpp tensor (unknown names pass through, and fail verification)."""
    stem, _, kind = name.rpartition(".")  # kind: weight | scales | biases | bias
    block = re.fullmatch(r"blk\.(0|[1-9][0-9]{0,8})\.(\w+)", stem)
    if block:
        mapped = _LAYER_NAMES.get(block.group(2))
        return f"model.layers.{block.group(1)}.{mapped}.{kind}" if mapped else name
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
    if rows % (2 * heads):
        raise WeightMismatchError(f"{plain(name)}: {rows} rows do not split into {heads} heads of rotary pairs")
    split = array.reshape(heads, rows // heads // 2, 2, *array.shape[1:])
    return split.swapaxes(1, 2).reshape(array.shape)
