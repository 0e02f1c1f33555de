"""Read a GGUF file as a Hugging Face-style config and weights.

gguf_file.py validates the header and turns Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K tensors into MLX
affine quantized arrays (weight, scales, biases) and MXFP4 ones into MLX mxfp4
(weight, scales); gguf_arch.py and each family's file (mlxinfer/families/) hold each
architecture's keys and names. What is left here: applying them, and undoing
what llama.cpp's converter did to the values (Q/K rows, Gemma's norms).
See https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import logging
import math
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from ..errors import ConfigError, CorruptFileError, UnsupportedModelError, WeightMismatchError
from ..formats.gguf_file import AFFINE, MXFP4, REPACKED, SCALE_BYTES, GGUFFile, QuantizedTensor, TensorInfo
from ..formats.gguf_requant import HELD_WIDER, REQUANTIZED
from ..untrusted import is_int, plain, shown
from .gguf_arch import BARE, TOP_NAMES, GGUFArch, Meta, architecture, common_config, conventions_of, layer_name
from .gguf_rope import llama3_from_rope_freqs
from .sizing import StoredTensor

log = logging.getLogger(__name__)
_REQUIRED = Meta.REQUIRED
CONSUMED = frozenset({"rope_freqs.weight"})  # read into the config (gguf_rope.py), not a weight


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, mx.array], dict[str, Any]]:
    """Return (config.json-style dict, HF-named weights, raw metadata)."""
    with GGUFFile(path) as gguf:
        config = gguf_config(gguf)
        return config, gguf_weights(gguf, config), gguf.metadata


def gguf_weights(
    gguf: GGUFFile, config: dict[str, Any], keep: Callable[[str], bool] | None = None
) -> dict[str, mx.array]:
    """Every tensor of an open GGUF file (or those whose Hugging Face name `keep` accepts) as MLX arrays under
    its Hugging Face name; the others are never read."""
    weights: dict[str, mx.array] = {}
    _note_mxfp4(gguf)
    note_requantized(gguf)
    for hf_name, name in hf_names(gguf).items():
        if keep is not None and not keep(hf_name):
            continue
        try:
            weights.update(to_mlx(hf_name, from_llama_cpp(hf_name, gguf.read(name), config)))
        except WeightMismatchError as e:
            raise WeightMismatchError(f"{gguf.path}: {e}") from None
    return weights


def _note_mxfp4(gguf: GGUFFile) -> None:
    """One info line for MXFP4 tensors (gpt-oss's experts): kept as MLX mxfp4, exactly as stored."""
    mxfp4 = [n for n, t in gguf.tensors.items() if t.ggml_type == MXFP4]
    if mxfp4:
        log.info("%s: %d MXFP4 tensors (e.g. %s) are kept as MLX mxfp4", gguf.path, len(mxfp4), plain(mxfp4[0]))


def note_requantized(gguf: GGUFFile) -> None:
    """One line for the types no MLX group holds as they are (gguf_requant.py): what each becomes."""
    from gguf import GGMLQuantizationType

    counts = Counter(t.ggml_type for t in gguf.tensors.values() if t.ggml_type in REQUANTIZED)
    parts = [
        f"{n} {GGMLQuantizationType(kind).name} tensors to MLX {REQUANTIZED[kind][0]}-bit group {REQUANTIZED[kind][1]}"
        for kind, n in sorted(counts.items())
    ]
    if parts:
        why = "rounded once more (no MLX group holds these blocks as they are)"
        if any(kind in HELD_WIDER for kind in counts):
            why += "; IQ1/IQ2 at 3 bits, more memory than the file: on MLX's 2-bit grid they answer nonsense"
        log.warning("%s: %s: %s", gguf.path.name, "; ".join(parts), why)


def gguf_tensors(gguf: GGUFFile, compute_size: int) -> dict[str, StoredTensor]:
    """Each tensor's logical shape and its bytes once loaded: a repacked type's packed codes plus a scale and a
    bias per group, as stored or in the compute dtype if narrower (MXFP4: codes and exponent bytes, as stored),
    others as floats."""

    def stored(info: TensorInfo) -> StoredTensor:
        elements = math.prod(info.shape)
        if info.ggml_type not in REPACKED:
            return StoredTensor(info.shape, elements * compute_size)
        if info.ggml_type == MXFP4:
            return StoredTensor(info.shape, info.nbytes)
        bits, group = AFFINE[info.ggml_type]
        scale_bytes = SCALE_BYTES[info.ggml_type]  # held as stored when narrower (loader.kept_as_stored)
        return StoredTensor(info.shape, elements * bits // 8 + 2 * (elements // group) * min(scale_bytes, compute_size))

    return {hf: stored(gguf.tensors[name]) for hf, name in hf_names(gguf).items()}


def hf_names(gguf: GGUFFile) -> dict[str, str]:
    """Hugging Face name -> GGUF name; two tensors that would land on one name are refused."""
    names: dict[str, str] = {}
    claimed: dict[str, str] = {}
    _, arch = architecture(gguf.path, gguf.metadata)
    for name, info in gguf.tensors.items():
        if name in CONSUMED:
            continue
        hf_name = hf_tensor_name(name, arch)
        stem = hf_name.removesuffix(".weight")
        # A Q4/Q5/Q8 weight also brings its scales and biases, an MXFP4 one its scales (see to_mlx).
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
    path, md = gguf.path, gguf.metadata
    name, arch = architecture(path, md)
    meta = Meta(path, md, name, gguf.tensors)
    config: dict[str, Any] = {"model_type": arch.model_type, **common_config(meta, *arch.defaults)}
    config["rope_scaling"] = _rope_scaling(meta)
    config.update(arch.extra(meta))
    if "rope_freqs.weight" in gguf.tensors:
        config["rope_scaling"] = llama3_from_rope_freqs(gguf, config)
    tokens = md.get("tokenizer.ggml.tokens", [])
    if not isinstance(tokens, list):
        raise ConfigError(f"{path}: GGUF metadata 'tokenizer.ggml.tokens' must be a list, got {shown(tokens)}")
    vocab = meta.int("vocab_size", len(tokens) if tokens else _REQUIRED)
    config["vocab_size"] = vocab
    config["tie_word_embeddings"] = "output.weight" not in gguf.tensors
    # An id outside the vocabulary is refused here, by its GGUF key (llama.cpp writes none for "no token"),
    # but for a BOS the model never adds: llama.cpp then ignores it, and so do we (see tokenizer/gguf_vocab.py).
    config["bos_token_id"] = _bos_token_id(path, md, vocab)
    config["eos_token_id"] = meta.int("tokenizer.ggml.eos_token_id", None, low=0, high=vocab - 1, prefix=False)
    return config


def to_mlx(hf_name: str, value: np.ndarray | QuantizedTensor) -> dict[str, mx.array]:
    """MLX arrays for one tensor read from GGUF: one float array, or a quantized weight and its scales
    (and biases, affine)."""
    if isinstance(value, QuantizedTensor):
        stem = hf_name.removesuffix(".weight")
        out = {hf_name: mx.array(value.weight), f"{stem}.scales": mx.array(value.scales)}
        if value.biases is not None:  # mxfp4 has none
            out[f"{stem}.biases"] = mx.array(value.biases)
        return out
    if value.dtype == np.uint16:  # bf16 bits
        return {hf_name: mx.array(value).view(mx.bfloat16)}
    return {hf_name: mx.array(value)}


def _bos_token_id(path: Path, md: dict[str, Any], vocab: int) -> int | None:
    key = "tokenizer.ggml.bos_token_id"
    value = md.get(key)
    if is_int(value) and not 0 <= value < vocab and md.get("tokenizer.ggml.add_bos_token") in (None, False, 0):
        log.warning(
            "%s: GGUF metadata %r is %s, outside the vocabulary, and never added; ignored", path, key, shown(value)
        )
        return None
    return Meta(path, md, "", {}).int(key, None, low=0, high=vocab - 1, prefix=False)


def _rope_scaling(meta: Meta) -> dict[str, Any] | None:
    kind = meta.str("rope.scaling.type")
    if kind is None or kind == "none" or kind == "yarn" and meta.arch == "gpt-oss":  # gpt-oss: see gguf_arch
        return None
    if kind != "linear":
        raise UnsupportedModelError(
            f"{meta.path}: GGUF {meta.arch}.rope.scaling.type={shown(kind)} is not supported (only 'linear')"
        )
    return {"type": "linear", "factor": meta.float("rope.scaling.factor", 1.0)}


def hf_tensor_name(name: str, arch: GGUFArch) -> str:
    """The Hugging Face name of a llama.cpp tensor (unknown names pass through, and fail verification)."""
    if name.endswith(".attn_sinks"):  # gpt-oss sinks, should a writer leave off the suffix
        name += ".weight"
    stem, _, kind = name.rpartition(".")  # kind: weight | scales | biases | bias
    block = re.fullmatch(r"blk\.(0|[1-9][0-9]{0,8})\.(\w+)", stem)
    if block:
        mapped = layer_name(arch, block.group(2))
        if mapped in BARE:
            return f"model.layers.{block.group(1)}.{mapped}"
        return f"model.layers.{block.group(1)}.{mapped}.{kind}" if mapped else name
    mapped = TOP_NAMES.get(stem)
    return f"{mapped}.{kind}" if mapped else name


def from_llama_cpp(name: str, value: np.ndarray | QuantizedTensor, config: dict[str, Any]) -> Any:
    """Undo what llama.cpp's converter did to one tensor: Q/K row order (llama), 1 + w norms (Gemma)."""
    arch = conventions_of(config["model_type"])
    if arch.permutes_qk:
        value = unpermute_rows(name, value, config)
    if arch.norm_shift and name.endswith("norm.weight") and isinstance(value, np.ndarray):
        if value.dtype == np.uint16:  # bf16 bits: widen to float32 first
            value = (value.astype(np.uint32) << 16).view(np.float32)
        value = value.astype(np.float32) - np.float32(arch.norm_shift)
    return value


def unpermute_rows(name: str, array: Any, config: dict[str, Any]) -> Any:
    """Undo llama.cpp's Q/K row order for one tensor (mx or numpy array); others pass through."""
    # llama.cpp's converter reorders Q and K rows from HF's "rotate half" layout to
    # interleaved pairs (permute(w, n_head): (n_head, 2, d/2, ...) -> (n_head, d/2, 2, ...)).
    # Without undoing it, RoPE rotates the wrong pairs and the text degrades within
    # a few tokens. Rows are the output features, so packed quantized weights,
    # scales and biases all permute the same way.
    if isinstance(array, QuantizedTensor):
        biases = None if array.biases is None else unpermute_rows(name, array.biases, config)
        weight, scales = (unpermute_rows(name, a, config) for a in (array.weight, array.scales))
        return QuantizedTensor(weight, scales, biases, array.bits, array.group_size, array.mode)
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
