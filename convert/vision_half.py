"""A vision-language checkpoint converted whole: its language model quantized as asked, its image half kept.

The vision tower and projector stay in float (the output dtype): they are a small share of the weights (Gemma 3
4B: 0.4 of 4.3 billion parameters) and every image passes through all of them. The output is in mlx-vlm's layout,
which mlx-lm's loader reads too (it drops the image half): the text tensors under `language_model.`, the image
half under the family's mlx-vlm names (models/vision.py `exported`), config.json the wrapper's with the converted
text config nested and the quantization block's per-layer entries named by those paths; the image processor's
files are copied. Only where mlxinfer reads the family's images (a VISION builder, preprocessor_config.json in the
folder) and mlx-lm reads the wrapper's layout (Gemma 3 and 4, Mistral 3; not SmolVLM, which mlx-lm has no module for);
any other vision-language source converts to its text model alone, as before.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from mlxinfer.models.checkpoint import Checkpoint
from mlxinfer.models.dtype import dtype_name
from mlxinfer.models.vision import VisionModel, build_vision
from mlxinfer.vision import PREPROCESSOR_FILE

TEXT_PREFIX = "language_model."  # mlx-vlm's and mlx-lm's wrapper modules hold the text model here
PROCESSOR_FILES = (PREPROCESSOR_FILE, "processor_config.json")
_QUANTIZATION_KEYS = ("group_size", "bits", "mode")


class VisionHalf:
    """The image half of one source, read lazily: each tensor is read when it is written."""

    def __init__(self, checkpoint: Checkpoint, model: VisionModel):
        self.config = checkpoint.config
        self.folder = checkpoint.folder
        self._model = model

    @classmethod
    def of(cls, checkpoint: Checkpoint) -> VisionHalf | None:
        """The image half to keep, None where the source converts to its text model alone."""
        model = build_vision(checkpoint, mx.float32, str(checkpoint.folder))
        return cls(checkpoint, model) if model is not None and model.converts_whole else None

    def names(self) -> dict[str, int]:
        """{output name: dimensions} of every tensor it writes."""
        return {self._model.exported(n): v.ndim for n, v in tree_flatten(self._model.parameters())}

    def nbytes(self, dtype: mx.Dtype) -> int:
        return sum(math.prod(v.shape) for _, v in tree_flatten(self._model.parameters())) * dtype.size

    def tensors(self, dtype: mx.Dtype) -> Iterator[tuple[str, mx.array]]:
        """(output name, tensor in `dtype`), one at a time."""
        for name, value in tree_flatten(self._model.parameters()):
            yield self._model.exported(name), value.astype(dtype)


def text_prefix(source: Any) -> str:
    """What the converter puts before each text tensor's name: the wrapper's prefix where the image half is kept."""
    return TEXT_PREFIX if getattr(source, "vision", None) is not None else ""


def wrapped(source: Any, text: dict[str, Any]) -> dict[str, Any]:
    """config.json of the output: `text` (the converted text model's), nested in the wrapper's where the image half
    is kept."""
    vision: VisionHalf | None = getattr(source, "vision", None)
    if vision is None:
        return text
    drop = ("quantization", "quantization_config", "torch_dtype")
    out = {k: v for k, v in vision.config.items() if k not in drop}  # the wrapper's architectures kept
    out["text_config"] = {k: v for k, v in text.items() if k not in (*drop, "architectures")}
    # A family's mlx-lm form may rename the text model_type to the wrapper's (Qwen3.5: qwen3_5, read flat); nested,
    # it stays the source's (mlx-lm's wrapper modules read text_config whatever it says).
    source_text = vision.config.get("text_config")
    if isinstance(source_text, dict) and "model_type" in source_text:
        out["text_config"]["model_type"] = source_text["model_type"]
    if "mm_tokens_per_image" in vision.config:  # mlx-vlm's Gemma 3 reads it from text_config (else 256)
        out["text_config"]["mm_tokens_per_image"] = vision.config["mm_tokens_per_image"]
    if "vocab_size" in text:  # mlx-lm's gemma3 reads it here (its default is Gemma 3's 262,208)
        out["vocab_size"] = text["vocab_size"]
    if out.get("audio_config") is not None:  # Gemma 4's audio half is never written: the output has none
        out["audio_config"] = None
    out["torch_dtype"] = text.get("torch_dtype")
    if "quantization" in text:
        block = {(k if k in _QUANTIZATION_KEYS else TEXT_PREFIX + k): v for k, v in text["quantization"].items()}
        out["quantization"] = out["quantization_config"] = block
    return out


def write_vision(source: Any, writer: Any, dtype: mx.Dtype) -> int:
    """The image half's tensors into `writer` (a ShardWriter); returns their bytes (0 where none is kept)."""
    vision: VisionHalf | None = getattr(source, "vision", None)
    written = 0
    for name, value in vision.tensors(dtype) if vision is not None else ():
        writer.add(name, value)
        written += value.nbytes
    return written


def vision_names(source: Any) -> dict[str, int]:
    vision: VisionHalf | None = getattr(source, "vision", None)
    return vision.names() if vision is not None else {}


def vision_bytes(source: Any, dtype: mx.Dtype) -> int:
    vision: VisionHalf | None = getattr(source, "vision", None)
    return vision.nbytes(dtype) if vision is not None else 0


def image_half(source: Any, dtype: mx.Dtype) -> str | None:
    """What the manifest says of the image half: kept, in which dtype; None where none is kept."""
    vision: VisionHalf | None = getattr(source, "vision", None)
    return None if vision is None else f"kept in {dtype_name(dtype)} (vision tower and projector)"
