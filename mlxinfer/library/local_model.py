"""What one model on this machine is, from its side files only (config.json, a GGUF file's first metadata keys).

Nothing is loaded: a listing stays cheap however large the weights, and a file that cannot be read leaves fields None.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError, MlxInferError
from ..formats.gguf_file import read_metadata
from ..untrusted import is_int, plain, read_json_object
from .catalog import disk_bytes

log = logging.getLogger(__name__)

MODELS_DIR, CACHE, HF_CACHE, ADDED = "models dir", "cache", "hf cache", "added"
MAX_CONFIG_BYTES = 4 << 20  # config.json of a real model is a few KB (vision-language ones tens of KB)
MAX_GGUF_KEYS = 64  # general.* keys come first; the tokenizer's arrays after them are never read
MAX_GGUF_STRING = 1 << 16
# String-list items stepped over one by one before general.file_type: general.tags, general.languages and the like
# hold tens; a vocabulary (tens of thousands) ends the walk instead.
MAX_GGUF_LISTED_ITEMS = 4096
GGUF_FACTS = ("general.architecture", "general.file_type")
_TORCH_DTYPE_BITS = {"float32": 32, "float16": 16, "bfloat16": 16}


@dataclass(frozen=True)
class LocalModel:
    """One loadable model on this machine, as `mlxinfer ls` shows it."""

    name: str  # what users and API requests call it: folder name, GGUF file stem, or "org/name" (hub cache)
    path: Path  # the folder or .gguf file to load
    source: str  # MODELS_DIR, CACHE, HF_CACHE or ADDED
    family: str | None  # config.json model_type, or the GGUF general.architecture
    verified: bool | None  # True: checked against transformers; False: mlx-lm's code (fallback); None: unknown
    bits: int | None  # quantized bits, or 16/32 from torch_dtype; None when nothing says
    size_bytes: int
    complete: bool  # False: the folder had more entries than disk_bytes counts
    last_used: float | None  # unix time of the last record_use

    @property
    def support(self) -> str:
        return {True: "verified", False: "fallback", None: "unknown"}[self.verified]

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "path": str(self.path), "support": self.support}


def describe(name: str, path: Path, source: str, last_used: float | None = None) -> LocalModel:
    """What `path` is, from its config.json or GGUF header; a file that cannot be read leaves fields None.

    Example:
        >>> describe("SmolLM2-4bit", models_dir() / "SmolLM2-4bit", MODELS_DIR).bits
        4
    """
    size, complete = disk_bytes(path)
    if path.suffix == ".gguf" and not path.is_dir():
        family, bits = gguf_facts(path)
        verified = _gguf_verified(family)
    else:
        raw = read_config(path)
        family = plain(raw["model_type"]) if isinstance(raw.get("model_type"), str) else None
        verified, bits = _config_verified(raw, path), _config_bits(raw)
    return LocalModel(name, path, source, family, verified, bits, size, complete, last_used)


def read_config(folder: Path) -> dict[str, Any]:
    """A model folder's config.json (at most MAX_CONFIG_BYTES), or {} with a warning when it cannot be read."""
    try:
        return read_json_object(folder / "config.json", ConfigError, limit=MAX_CONFIG_BYTES)
    except ConfigError as e:
        log.warning("%s", e)
        return {}


def gguf_facts(path: Path) -> tuple[str | None, int | None]:
    """general.architecture and the bits of general.file_type, from the first metadata keys of a GGUF file.

    Reads at most MAX_GGUF_KEYS keys and stops once both are found or a long list (the tokenizer's) comes up, so
    a file's vocabulary is never read; an unreadable or malformed header gives (None, None)."""
    try:
        found = read_metadata(
            path,
            GGUF_FACTS,
            max_keys=MAX_GGUF_KEYS,
            max_value_bytes=MAX_GGUF_STRING,
            max_skipped_items=MAX_GGUF_LISTED_ITEMS,
        )
    except (MlxInferError, OSError):
        return None, None
    family = found.get("general.architecture")
    return (plain(family) if isinstance(family, str) else None), file_type_bits(found.get("general.file_type"))


def file_type_name(file_type: Any) -> str | None:
    """llama.cpp's name for a GGUF general.file_type (its LlamaFileType: 7 -> "MOSTLY_Q8_0"), or None."""
    if not is_int(file_type):
        return None
    try:
        from gguf import LlamaFileType

        return LlamaFileType(int(file_type)).name
    except (ImportError, ValueError):
        return None


def file_type_bits(file_type: Any) -> int | None:
    """Bits of llama.cpp's LLAMA_FTYPE: MOSTLY_Q4_1 -> 4, MOSTLY_Q8_0 -> 8, MOSTLY_F16 -> 16, ALL_F32 -> 32."""
    name = file_type_name(file_type)
    if name is None:
        return None
    for marker, bits in (("F32", 32), ("F16", 16), ("BF16", 16)):
        if name.endswith(marker):
            return bits
    digits = name.split("Q")[-1][:1]  # MOSTLY_Q4_K_M, MOSTLY_IQ2_XS, MOSTLY_TQ1_0
    return int(digits) if digits.isdigit() else None


def _config_verified(raw: dict[str, Any], path: Path) -> bool | None:
    """Whether mlxinfer runs this config.json as verified (True) or through mlx-lm's code (False); None when it
    cannot run it at all (a listing never fails on one model)."""
    if not raw:
        return None
    from ..models.config import normalize_config

    try:
        return normalize_config(raw, str(path / "config.json")).verified
    except (MlxInferError, TypeError, ValueError, KeyError, AttributeError):
        return None


def _config_bits(raw: dict[str, Any]) -> int | None:
    for key in ("quantization", "quantization_config"):
        section = raw.get(key)
        if isinstance(section, dict) and is_int(section.get("bits")) and 0 < section["bits"] <= 32:
            return int(section["bits"])
    return _TORCH_DTYPE_BITS.get(str(raw.get("torch_dtype") or raw.get("dtype")))


def _gguf_verified(family: str | None) -> bool | None:
    from ..models.gguf_arch import GGUF_FAMILIES
    from ..models.registry import ARCHITECTURES as VERIFIED

    # A table lookup and a file-name test: listing models imports no family's code.
    return True if GGUF_FAMILIES.get(family or "") in VERIFIED else None
