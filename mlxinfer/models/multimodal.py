"""Vision-language checkpoints' text model: the nested text config, the text tensors.

Gemma 3 (`gemma3`, Gemma3ForConditionalGeneration) and Qwen3.5 (`qwen3_5`,
Qwen3_5ForConditionalGeneration) keep a complete decoder under text_config and
`language_model` tensor prefixes; with text-only prompts the full model computes
exactly that decoder. The image half is models/vision.py's, for the families whose
file has a VISION builder (Gemma 3 and 4, SmolVLM, Mistral 3, Qwen3.5, Qwen3-VL); for the others the vision
tensors are never read (MLX maps tensors lazily and they are dropped unevaluated), and one log line says so.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ..display import mib, plural
from ..errors import ConfigError, CorruptFileError, UnsupportedModelError
from ..formats.safetensors_header import DTYPE_BYTES
from ..untrusted import plain, shown, shown_path

if TYPE_CHECKING:
    from .checkpoint import Checkpoint

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Wrapper:
    """How one vision-language model_type holds its text model."""

    text_type: str  # text_config's model_type
    tied_by_default: bool  # the wrapper's own tie_word_embeddings default (it owns lm_head)
    # Stored tensor-name prefix -> the text model's (transformers 5 saves the first form; MLX ports the second).
    text_prefixes: tuple[tuple[str, str], ...]
    vision_prefixes: tuple[str, ...]  # vision tower and projector: skipped
    # transformers' text config values for keys a nested text_config may leave out (google/gemma-3-4b-it
    # names only the sizes that differ).
    text_defaults: dict[str, Any] = field(default_factory=dict)
    # Text-model keys the wrapper's forward ignores: Gemma3ForConditionalGeneration never soft-caps its logits.
    ignored: tuple[str, ...] = ()
    # A config with neither text_config nor vision_config is the text model itself (mlx-lm has no module of
    # the text model_type, so converted Qwen3.5 text models say the wrapper's).
    flat_text: bool = False
    # Other text model_types the wrapper may hold (Mistral 3: a mistral or a ministral3 text model).
    other_text_types: tuple[str, ...] = ()


_LANGUAGE_MODEL = (("model.language_model.", "model."), ("language_model.model.", "model."),
                   ("language_model.lm_head.", "lm_head."))  # fmt: skip

# Vision tower and projector, under both transformers 5's prefix and the older one (Gemma 3, Mistral 3).
_TOWER_AND_PROJECTOR = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)
_QWEN_VISUAL = ("model.visual.", "visual.", "vision_tower.")

_SMOLVLM = Wrapper(
    "llama",
    tied_by_default=False,  # SmolVLMConfig's and Idefics3Config's default
    text_prefixes=(("model.text_model.", "model."),),
    vision_prefixes=("model.vision_model.", "model.connector.", "vision_model.", "connector."),
)
_LFM2_VL = Wrapper(
    "lfm2",
    tied_by_default=True,  # Lfm2VlConfig's default
    text_prefixes=_LANGUAGE_MODEL,
    vision_prefixes=_TOWER_AND_PROJECTOR,
)
WRAPPERS: dict[str, Wrapper] = {
    "gemma3": Wrapper(
        "gemma3_text",
        tied_by_default=True,
        text_prefixes=_LANGUAGE_MODEL,
        vision_prefixes=_TOWER_AND_PROJECTOR,
        text_defaults={
            "vocab_size": 262_208,
            "hidden_size": 2304,
            "intermediate_size": 9216,
            "num_hidden_layers": 26,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "hidden_activation": "gelu_pytorch_tanh",
            "max_position_embeddings": 131_072,
            "rms_norm_eps": 1e-6,
            "query_pre_attn_scalar": 256,
            "sliding_window": 4096,
        },
        ignored=("final_logit_softcapping",),
    ),
    "qwen3_5": Wrapper(
        "qwen3_5_text",
        tied_by_default=False,
        text_prefixes=_LANGUAGE_MODEL,
        vision_prefixes=_QWEN_VISUAL,
        flat_text=True,
    ),
    "qwen3_5_moe": Wrapper(
        "qwen3_5_moe_text",
        tied_by_default=False,
        text_prefixes=_LANGUAGE_MODEL,
        vision_prefixes=_QWEN_VISUAL,
        flat_text=True,
    ),
    "qwen3_vl": Wrapper(
        "qwen3_vl_text",
        tied_by_default=False,
        text_prefixes=_LANGUAGE_MODEL,
        vision_prefixes=_QWEN_VISUAL,
        flat_text=True,
    ),
    "mistral3": Wrapper(
        "mistral",
        tied_by_default=True,  # Mistral3Config's default
        text_prefixes=_LANGUAGE_MODEL,
        vision_prefixes=_TOWER_AND_PROJECTOR,
        other_text_types=("ministral3",),
    ),
    "gemma4": Wrapper(
        "gemma4_text",
        tied_by_default=True,
        text_prefixes=_LANGUAGE_MODEL,
        vision_prefixes=(
            "model.vision_tower.",
            "model.embed_vision.",
            "model.audio_tower.",
            "model.embed_audio.",
            "vision_tower.",
            "embed_vision.",
            "audio_tower.",
            "embed_audio.",
        ),
    ),
    "lfm2_vl": _LFM2_VL,
    "lfm2-vl": _LFM2_VL,  # the Hub's LFM2-VL configs spell it so (mlx-lm's module too)
    "smolvlm": _SMOLVLM,
    # Idefics3ForConditionalGeneration: SmolVLM's model under its first name (SmolVLM v1 checkpoints say it).
    "idefics3": _SMOLVLM,
}
# Keys of the outer config that hold for the text model too (the loader's refusals read them there).
_CARRIED = ("model_file", "auto_map", "quantization", "quantization_config")
_MAX_IDS = 257  # normalize_config refuses more than 256 eos ids; merging never scans past that


def wrapper_of(raw: dict[str, Any]) -> Wrapper | None:
    """The Wrapper of a vision-language config.json, else None (normalize_config judges any other model_type)."""
    model_type = raw.get("model_type")
    return WRAPPERS.get(model_type) if isinstance(model_type, str) else None


def text_config(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """The text model's config of a vision-language config.json; any other config as it is.

    Example:
        >>> text_config({"model_type": "gemma3", "text_config": {...}}, "config.json")["model_type"]
        'gemma3_text'
    """
    wrapper = wrapper_of(raw)
    if wrapper is None:
        return raw
    nested = raw.get("text_config")
    if wrapper.flat_text and "text_config" not in raw and "vision_config" not in raw:
        return {**raw, "model_type": wrapper.text_type}
    if not isinstance(nested, dict):
        raise ConfigError(f"{source}: model_type {raw['model_type']!r} needs a text_config object, got {shown(nested)}")
    text_type = nested.get("model_type", wrapper.text_type)
    if text_type != wrapper.text_type and text_type not in wrapper.other_text_types:
        raise UnsupportedModelError(
            f"{source}: text_config.model_type is {shown(text_type)}; {raw['model_type']} holds a {wrapper.text_type}"
        )
    text = {**wrapper.text_defaults, **nested, "model_type": text_type}
    for key in wrapper.ignored:
        text.pop(key, None)
    text.update({key: raw[key] for key in _CARRIED if key in raw})
    # The wrapper owns lm_head, so its own setting ties it (transformers reads the outer config).
    text["tie_word_embeddings"] = raw.get("tie_word_embeddings", wrapper.tied_by_default)
    if raw.get("bos_token_id") is not None:
        text["bos_token_id"] = raw["bos_token_id"]
    if raw.get("eos_token_id") is not None:  # the outer ids (with generation_config.json's) add to the text model's
        text["eos_token_id"] = _merged(text.get("eos_token_id"), raw["eos_token_id"])
    return text


def _merged(first: Any, second: Any) -> list[Any]:
    ids: list[Any] = []
    for value in [*_as_list(first)[:_MAX_IDS], *_as_list(second)[:_MAX_IDS]]:
        if value is not None and value not in ids:
            ids.append(value)
    return ids


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


SKIPPED_AT_LOAD = "images are not supported, the text model runs alone"


def text_checkpoint(checkpoint: Checkpoint, vision_loaded: bool = False, why: str = SKIPPED_AT_LOAD) -> Checkpoint:
    """`checkpoint` as its text model: text tensors under the names the model uses, vision tensors left out
    (never read here; logged as skipped, with `why`, unless `vision_loaded`). A checkpoint of a text model comes
    back as it is."""
    wrapper = wrapper_of(checkpoint.config)
    if wrapper is None:
        return checkpoint
    names, skipped = text_names(checkpoint.tensors, wrapper)
    if skipped and not vision_loaded:
        _log_skipped(checkpoint, skipped, why)
    tensors = {name: checkpoint.tensors[stored] for name, stored in names.items()}
    return replace(checkpoint, tensors=tensors, stored_names=names)


def text_names(stored: Mapping[str, Any], wrapper: Wrapper) -> tuple[dict[str, str], list[str]]:
    """({name in the text model: stored name}, [skipped vision tensor names]) for the tensors in `stored`.

    Names under no known prefix stay as they are: verify_weights then reports any the model does not have."""
    names: dict[str, str] = {}
    skipped: list[str] = []
    for name in stored:
        if name.startswith(wrapper.vision_prefixes):
            skipped.append(name)
            continue
        ours = next((new + name[len(old) :] for old, new in wrapper.text_prefixes if name.startswith(old)), name)
        if ours in names:
            raise CorruptFileError(f"tensors {plain(names[ours])} and {plain(name)} are both the text model's {ours}")
        names[ours] = name
    return names, skipped


def _log_skipped(checkpoint: Checkpoint, skipped: list[str], why: str) -> None:
    nbytes = sum(math.prod(checkpoint.tensors[n].shape) * DTYPE_BYTES[checkpoint.tensors[n].dtype] for n in skipped)
    files = sorted({checkpoint.owners[n].name for n in skipped if n in checkpoint.owners})
    where = ", ".join(files) or "the weights"
    log.warning(
        "%s: skipped the vision tower (%s, %s in %s); %s",
        shown_path(checkpoint.folder),
        plural(len(skipped), "tensor"),
        mib(nbytes) if nbytes >= 1 << 20 else f"{nbytes:,} bytes",
        where,
        why,
    )
