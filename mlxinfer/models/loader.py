"""Load a model folder or GGUF file into a ready-to-run DecoderLM.

Steps: read config and headers -> normalize config -> build the architecture ->
quantize layers the checkpoint stores quantized -> check every tensor name and
shape -> cast to the compute dtype -> load.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from .. import blas
from ..errors import ModelNotFoundError, WeightMismatchError
from ..formats.gguf_file import GGUFFile
from ..formats.recommended_sampling import (
    GENERATION_CONFIG,
    SamplingDefaults,
    from_generation_config,
    from_gguf_metadata,
)
from ..formats.safetensors_header import DTYPE_BYTES, FLOAT_DTYPES, TensorInfo
from ..memory.machine import machine_memory
from ..tokenizer import Tokenizer
from ..tokenizer.gguf_vocab import tokenizer_from_gguf
from ..untrusted import listed
from .checkpoint import Checkpoint, load_tensors, open_folder
from .config import ModelConfig, normalize_config
from .cpu_weights import WeightChoice, choose_cpu_weights, cpu_weights_mode
from .decoder import DecoderLM, build_model
from .dtype import choose_compute_dtype
from .fallback import UNVERIFIED
from .gguf import gguf_config, gguf_tensors, gguf_weights
from .multimodal import text_checkpoint
from .quantized import quantize_like
from .shard import Stage, keep_layers, select_weights, shard_tensor
from .sizing import StoredTensor, check_before_build
from .vision import VisionModel, load_vision

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """A model ready to run, with what was learned while loading it."""

    model: DecoderLM
    config: ModelConfig
    tokenizer: Tokenizer | None
    compute_dtype: mx.Dtype
    path: Path
    quantized_layers: int
    weights_bytes: int
    load_s: float
    weights: WeightChoice = WeightChoice("as stored", "not chosen")  # quantized or dequantized on this CPU
    vision: VisionModel | None = None  # a vision-language model's image half (weights_bytes counts it)
    sampling: SamplingDefaults = SamplingDefaults()  # what the model's authors recommend, where they say


def load_model(
    path: str | Path,
    dtype: str | None = None,
    with_tokenizer: bool = True,
    cpu_weights: str | None = None,
    stage: Stage | None = None,
    tensor_group: Any = None,
) -> LoadedModel:
    """Load `path` (a model folder or a .gguf file) for inference; with `stage`, only that pipeline rank's
    layers (plus the embeddings, final norm and head), the others' tensors never read; with `tensor_group`, every
    layer's share of the heads and MLP columns for that rank of the group (models/shard.py).

    Example:
        >>> loaded = load_model("models/SmolLM2-135M-Instruct")
        >>> loaded.model(mx.array([[1, 2, 3]])).shape
    """
    start = time.perf_counter()
    path = Path(path).expanduser()
    compute = choose_compute_dtype(dtype)
    vision = None
    if path.is_file() and path.suffix == ".gguf":
        config, weights, metadata = _read_gguf_checked(path, compute, stage)
        tokenizer = tokenizer_from_gguf(metadata, f"{path}: GGUF") if with_tokenizer else None
        sampling = from_gguf_metadata(metadata, f"{path}: GGUF metadata")
    elif path.is_dir():
        checkpoint = open_folder(path)
        sampling = from_generation_config(checkpoint.generation, str(path / GENERATION_CONFIG))
        config = normalize_config(checkpoint.config, source=str(path / "config.json"))
        vision = load_vision(checkpoint, compute, str(path)) if stage is None and tensor_group is None else None
        checkpoint = text_checkpoint(checkpoint, vision is not None)  # a vision-language model's text tensors
        check_before_build(config, _folder_tensors(checkpoint, compute), str(path))
        weights = load_tensors(checkpoint)
        tokenizer = Tokenizer.from_folder(path, config.eos_token_ids) if with_tokenizer else None
    else:
        raise ModelNotFoundError(f"{path}: not a model folder or .gguf file")
    model = build_model(config)
    weights = _sanitize(weights, config)
    if config.spec.mlx_sanitize:
        weights = model.mlx_sanitize(weights)
    if stage is not None:  # lazy arrays: another rank's tensors are dropped before anything reads them
        weights = select_weights(weights, stage)
        keep_layers(model, stage)
    quantize_mode = (config.quantization or {}).get("mode", "affine")
    quantized = quantize_like(model, weights, mode=quantize_mode, dtype=compute)
    verify_weights(model, weights, source=str(path))
    model.update(tree_unflatten([(k, _cast(k, v, compute)) for k, v in weights.items()]))
    if tensor_group is not None:  # before anything is evaluated: each whole tensor only passes through
        shard_tensor(model, tensor_group)
    del weights  # the lazy arrays, or every whole tensor read stays held
    mx.eval(model.parameters(), _private_arrays(model))
    model.eval()
    if mx.default_device().type == mx.DeviceType.cpu:  # before the CPU weights are timed: they use its GEMMs
        blas.activate()  # once per process; not at import, as the swap reaches every MLX user in it
    kept = choose_cpu_weights(model, compute, machine_memory().usable_bytes(), cpu_weights_mode(cpu_weights))
    nbytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))  # after the choice: what is held
    nbytes += vision.nbytes if vision is not None else 0
    log.info(
        "loaded %s: %d quantized layers (%s: %s), %.1f MB, %s%s",
        path,
        quantized,
        kept.kept,
        kept.reason,
        nbytes / 1e6,
        compute,
        f", with its vision tower ({vision.nbytes / 1e6:.1f} MB)" if vision is not None else "",
    )
    if not config.verified:
        log.warning("%s: model_type %s is %s", path, config.model_type, UNVERIFIED)
    took = time.perf_counter() - start
    return LoadedModel(model, config, tokenizer, compute, path, quantized, nbytes, took, kept, vision, sampling)


def _read_gguf_checked(
    path: Path, compute: mx.Dtype, stage: Stage | None = None
) -> tuple[ModelConfig, dict[str, mx.array], dict[str, Any]]:
    """Config, weights and metadata of a GGUF file; the weights are read only once the config fits them
    (with `stage`, only its layers' and the shared ones)."""
    with GGUFFile(path) as gguf:
        raw = gguf_config(gguf)
        config = normalize_config(raw, source=f"{path} (GGUF metadata)")
        check_before_build(config, gguf_tensors(gguf, compute.size), str(path))
        keep = None if stage is None else (lambda name: stage.owns(name) is not None)
        return config, gguf_weights(gguf, raw, keep), gguf.metadata


def _folder_tensors(checkpoint: Checkpoint, compute: mx.Dtype) -> dict[str, StoredTensor]:
    def stored(name: str, info: TensorInfo) -> StoredTensor:
        elements = math.prod(info.shape)
        floating = info.dtype in FLOAT_DTYPES
        packed = info.dtype == "U32" and f"{name.removesuffix('.weight')}.scales" in checkpoint.tensors
        size = DTYPE_BYTES[info.dtype]
        held = compute.size if floating and not kept_as_stored(name, size, compute.size) else size
        return StoredTensor(info.shape, elements * held, packed)

    return {name: stored(name, info) for name, info in checkpoint.tensors.items()}


def _private_arrays(model: nn.Module) -> list[mx.array]:
    """Arrays modules keep outside their parameters (RoPE frequency tables, `_freqs`).

    Evaluated here, on the loading thread: MLX's GPU streams belong to the thread that
    made them, and a still-lazy array would be computed later on a ServingThread's thread."""
    return [v for _, module in model.named_modules() for v in module.values() if isinstance(v, mx.array)]


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Only the tokenizer of a model folder or GGUF file."""
    path = Path(path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        with GGUFFile(path) as gguf:
            return tokenizer_from_gguf(gguf.metadata, f"{path}: GGUF")
    if not path.is_dir():
        raise ModelNotFoundError(f"{path}: not a model folder or .gguf file")
    config = normalize_config(open_folder(path).config, source=str(path / "config.json"))
    return Tokenizer.from_folder(path, config.eos_token_ids)


def verify_weights(model: nn.Module, weights: dict[str, mx.array], source: str) -> None:
    """Raise once, listing every missing, unexpected and wrong-shape tensor."""
    params = dict(tree_flatten(model.parameters()))
    missing = sorted(set(params) - set(weights))
    unexpected = sorted(set(weights) - set(params))
    common = sorted(set(params) & set(weights))
    wrong = [
        f"{k} (file {tuple(weights[k].shape)}, model {tuple(params[k].shape)})"
        for k in common
        if weights[k].shape != params[k].shape
    ]
    # Floats must stay floats and packed quantized words must stay uint32.
    bad_dtype = [f"{k} ({weights[k].dtype})" for k in common if _kind(weights[k].dtype) != _kind(params[k].dtype)]
    if missing or unexpected or wrong or bad_dtype:
        # Only `unexpected` names come from the file; listed() quotes the odd ones and caps how many show.
        groups = (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong), ("wrong dtype", bad_dtype))
        parts = [f"{label} ({len(items)}): {listed(items)}" for label, items in groups if items]
        raise WeightMismatchError(f"{source}: weights do not match the architecture; " + "; ".join(parts))


def _kind(dtype: mx.Dtype) -> str:
    return "float" if mx.issubdtype(dtype, mx.floating) else str(dtype)


def _sanitize(weights: dict[str, mx.array], config: ModelConfig) -> dict[str, mx.array]:
    # Precomputed rotary tables are recomputed from the config; a tied head has no weight.
    def kept(name: str) -> bool:
        tied_head = config.tie_word_embeddings and name.startswith("lm_head.")
        return not (tied_head or name.endswith("rotary_emb.inv_freq"))

    return {k: v for k, v in weights.items() if kept(k)}


def _cast(name: str, value: mx.array, dtype: mx.Dtype) -> mx.array:
    # Packed quantized weights are integers and stay as they are; float tensors follow the compute dtype, except
    # quantization scales and biases stored narrower than it (kept_as_stored).
    if not mx.issubdtype(value.dtype, mx.floating) or kept_as_stored(name, value.dtype.size, dtype.size):
        return value
    return value.astype(dtype)


def kept_as_stored(name: str, stored_size: int, compute_size: int) -> bool:
    """Whether a float tensor named `name` of `stored_size` bytes a value is held as stored, not in the compute dtype.

    Quantization scales and biases stored in 16 bits stay so under float32 compute: quantized_matmul widens them
    exactly at each call (QuantizedLookup does for a lookup's rows), and held at 32 bits they would add a bit per
    weight at group 32 (a GGUF Q8_0 model held at 1.18x its file instead of 1.06x)."""
    return name.endswith((".scales", ".biases")) and stored_size < compute_size
