"""What `mlxinfer show` (and Ollama's /api/show) tells about a model without loading it: sizes, chat template,
quantization, the sampling its files recommend. Every read is bounded; a file that cannot be read leaves its fields
empty, with a warning."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ..errors import ConfigError, MlxInferError
from ..formats.gguf_file import AFFINE, GGUFFile, read_metadata
from ..formats.recommended_sampling import (
    GENERATION_CONFIG,
    GGUF_KEYS,
    SamplingDefaults,
    from_generation_config,
    from_gguf_metadata,
)
from ..untrusted import first_line, is_int, read_json_object, read_text, shown_path
from .local_model import LocalModel, file_type_bits, file_type_name, read_config

log = logging.getLogger(__name__)

MAX_TEMPLATE_LINES = 5
MAX_TEMPLATE_BYTES = 1 << 20  # a chat template file or GGUF value; real ones are a few KB (the largest ~100 KB)
MAX_TOKENIZER_CONFIG_BYTES = 64 << 20  # tokenizer_config.json: its added_tokens_decoder can take megabytes
MAX_GGUF_ALL_KEYS = 1 << 16  # metadata keys walked looking for tokenizer.chat_template
MAX_GENERATION_CONFIG_BYTES = 1 << 20  # real ones are a few hundred bytes
MAX_GGUF_ITEMS = 1 << 24  # string items stepped over on the way (a vocabulary and its merges: ~10^5 each)


def details(model: LocalModel) -> dict[str, Any]:
    """A model's config summary: family, sizes, context, chat template and quantization; nothing is loaded.

    Example:
        >>> details(find_model("SmolLM2-4bit"))["quantization"]
        {'bits': 4, 'group_size': 64, 'mode': 'affine'}
    """
    if model.path.suffix == ".gguf" and not model.path.is_dir():
        config, template, quantization, sampling = _gguf_details(model.path)
    else:
        config, template, quantization = _folder_details(model.path)
        sampling = sampling_of(model.path)
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    sizes = {
        key: value if is_int(value) else None
        for key, value in (
            ("layers", text.get("num_hidden_layers")),
            ("hidden_size", text.get("hidden_size")),
            ("context", text.get("max_position_embeddings")),
            ("vocab_size", text.get("vocab_size")),
        )
    }
    lines = template.splitlines()[:MAX_TEMPLATE_LINES] if template else []
    return {
        **model.to_dict(),
        **sizes,
        "chat_template": {"present": bool(template), "first_lines": [line[:200] for line in lines]},
        "quantization": quantization,
        "sampling": {"defaults": sampling.in_force, "source": sampling.source or None, "text": sampling.describe()},
    }


def sampling_of(path: Path) -> SamplingDefaults:
    """The sampling a model's files recommend, read without loading it: a folder's generation_config.json, a GGUF
    file's general.sampling keys. Nothing stated, or unreadable (with a warning): none."""
    try:
        if path.suffix == ".gguf" and not path.is_dir():
            found = read_metadata(path, tuple(GGUF_KEYS), max_keys=MAX_GGUF_ALL_KEYS, max_skipped_items=MAX_GGUF_ITEMS)
            return _gguf_sampling(found, path)
        file = path / GENERATION_CONFIG
        if not file.is_file():
            return SamplingDefaults()
        return from_generation_config(read_json_object(file, ConfigError, limit=MAX_GENERATION_CONFIG_BYTES), str(file))
    except (MlxInferError, OSError) as e:
        log.warning("%s: no sampling defaults read (%s)", shown_path(path), first_line(e))
        return SamplingDefaults()


def chat_template(path: Path) -> str | None:
    """A model's chat template, read without its weights or tokenizer, or None (with a warning when a file is
    unreadable): a GGUF file's tokenizer.chat_template, else the folder's chat_template.jinja, tokenizer_config.json
    "chat_template", then chat_template.json (the order mlxinfer's tokenizer uses; a list of named templates
    gives "default"). Every read is bounded: MAX_TEMPLATE_BYTES per template, the GGUF header walked by sizes.

    Example:
        >>> chat_template(find_model("SmolLM2-4bit").path).startswith("{% for message in messages %}")
        True
    """
    if path.suffix == ".gguf" and not path.is_dir():
        return _gguf_template(path)
    try:
        if (path / "chat_template.jinja").is_file():
            return read_text(path / "chat_template.jinja", ConfigError, limit=MAX_TEMPLATE_BYTES)
        for name, limit in (("tokenizer_config.json", MAX_TOKENIZER_CONFIG_BYTES), ("chat_template.json", None)):
            if (path / name).is_file():
                value = read_json_object(path / name, ConfigError, limit=limit or MAX_TEMPLATE_BYTES)
                template = _named_template(value.get("chat_template"))
                if template is not None:
                    return template if len(template) <= MAX_TEMPLATE_BYTES else None
    except ConfigError as e:
        log.warning("%s", e)
    return None


def _named_template(value: Any) -> str | None:
    if isinstance(value, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default") or next(iter(named.values()), None)
    return value if isinstance(value, str) else None


def _gguf_template(path: Path) -> str | None:
    """tokenizer.chat_template from a GGUF header, found by walking its keys (the tokenizer's arrays before it are
    stepped over by their sizes); one longer than MAX_TEMPLATE_BYTES, or not a string, gives None."""
    try:
        found = read_metadata(
            path,
            ("tokenizer.chat_template",),
            max_keys=MAX_GGUF_ALL_KEYS,
            max_value_bytes=MAX_TEMPLATE_BYTES,
            max_skipped_items=MAX_GGUF_ITEMS,
        )
    except (MlxInferError, OSError) as e:
        log.warning("%s: no chat template read (%s)", shown_path(path), first_line(e))
        return None
    template = found.get("tokenizer.chat_template")
    return template if isinstance(template, str) else None


def _folder_details(folder: Path) -> tuple[dict[str, Any], str | None, dict[str, Any] | None]:
    config = read_config(folder)
    section = config.get("quantization") or config.get("quantization_config")
    quantization = None
    if isinstance(section, dict):
        mode = section.get("mode") or section.get("quant_method") or "affine"
        quantization = {"bits": section.get("bits"), "group_size": section.get("group_size"), "mode": mode}
        quantization = {k: v if isinstance(v, (int, str)) else None for k, v in quantization.items()}
    return config, chat_template(folder), quantization


def _gguf_sampling(metadata: dict[str, Any], path: Path) -> SamplingDefaults:
    try:
        return from_gguf_metadata(metadata, f"{path}: GGUF metadata")
    except ConfigError as e:
        log.warning("%s", e)
        return SamplingDefaults()


def _gguf_details(path: Path) -> tuple[dict[str, Any], str | None, dict[str, Any] | None, SamplingDefaults]:
    """The config mlxinfer would load a GGUF file with (its tensor table says which layers have biases, and how
    large the vocabulary is), its chat template, its llama.cpp file type and its sampling, from one read of the
    header."""
    from ..models.gguf import gguf_config

    try:
        with GGUFFile(path) as gguf:
            metadata = gguf.metadata
            try:
                config = gguf_config(gguf)
            except MlxInferError as e:  # an architecture mlxinfer cannot map: the sizes stay unknown
                log.warning("%s", e)
                config = {}
    except MlxInferError as e:
        log.warning("%s", e)
        return {}, None, None, SamplingDefaults()
    template = metadata.get("tokenizer.chat_template")
    file_type = metadata.get("general.file_type")
    name = file_type_name(file_type)
    group = _loaded_group(name)
    quantization = {"bits": file_type_bits(file_type), "group_size": group, "mode": f"gguf {name}" if name else "gguf"}
    return config, template if isinstance(template, str) else None, quantization, _gguf_sampling(metadata, path)


def _loaded_group(file_type: str | None) -> int | None:
    """The MLX group size the file's main type is held at once loaded (formats/gguf_file.AFFINE): MOSTLY_Q4_K_M ->
    Q4_K -> 32, MOSTLY_Q3_K_S -> Q3_K -> 64; None for float files and types kept as floats."""
    from gguf import GGMLQuantizationType

    if not file_type:
        return None
    names = {GGMLQuantizationType(kind).name: group for kind, (_, group) in AFFINE.items()}
    found = [name for name in names if name in file_type.removeprefix("MOSTLY_")]
    return names[max(found, key=len)] if found else None
