"""The local models every front end lists (`mlxinfer ls`, the menubar's Switch Model): what they are and where.

Four places: the models folder (catalog.models_dir()), mlxinfer's own cache (the default model), the Hugging
Face hub cache and files or folders the user added (a small JSON registry in the config folder). Each model is
described from its side files only (config.json, a GGUF file's first metadata keys): nothing is loaded.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import platformdirs

from ..default_model import cache_dir
from ..errors import ConfigError, LibraryError, MlxInferError
from ..untrusted import first_line, is_int, plain, read_json_object, read_text, shown_path
from .catalog import disk_bytes, local_models, models_dir

log = logging.getLogger(__name__)

MODELS_DIR, CACHE, HF_CACHE, ADDED = "models dir", "cache", "hf cache", "added"
REGISTRY_FILE = "models.json"  # in config_dir(): {"added": [absolute paths]}
USES_FILE = "last-used.json"  # in cache_dir(): {absolute path: unix time}
MAX_ADDED = 1000
MAX_USES = 1000
MAX_STATE_BYTES = 1 << 20  # either JSON file: a thousand paths take ~100 KB
MAX_CONFIG_BYTES = 4 << 20  # config.json of a real model is a few KB (vision-language ones tens of KB)
MAX_HF_REPOS = 1000  # folders in the hub cache looked at; a larger cache is skipped with a warning
MAX_GGUF_KEYS = 64  # general.* keys come first; the tokenizer's arrays after them are never read
MAX_GGUF_STRING = 1 << 16
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


def config_dir() -> Path:
    """Where mlxinfer keeps settings (the added models): $MLXINFER_CONFIG_DIR, else the platform's config folder."""
    override = os.environ.get("MLXINFER_CONFIG_DIR")
    return Path(override).expanduser() if override else Path(platformdirs.user_config_dir("mlxinfer"))


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, read from the environment now (huggingface_hub reads it once, at import)."""
    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(key):
            return Path(os.environ[key]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def list_models() -> list[LocalModel]:
    """Every model mlxinfer can find: models folder, its cache, the hub cache, then added ones; a path once.

    Example:
        >>> [(m.name, m.support, m.bits) for m in list_models()]
        [('SmolLM2-4bit', 'verified', 4), ('Qwen/Qwen3-0.6B', 'verified', 16)]
    """
    uses = _read_uses()
    seen: set[Path] = set()
    found = []
    for name, path, source in _entries():
        key = _key(path)
        if key in seen:  # MLXINFER_MODELS_DIR may be the cache's own folder, an added path may be in it
            continue
        seen.add(key)
        found.append(describe(name, path, source, uses.get(str(key))))
    return found


def find_model(name: str) -> LocalModel | None:
    """The first model called exactly `name` (case-sensitive), in list_models() order.

    Cheap enough for each request that names a model not loaded yet (and each 404): names are matched over the
    folder listings first and only the hit is described; the Hugging Face cache is looked into only for an
    "org/name" (that one repository's folder), never scanned whole."""
    seen: set[Path] = set()
    for entry, path, source in _entries(only=name):
        key = _key(path)
        if key in seen:  # as list_models(): a path once, under the name it was first listed with
            continue
        seen.add(key)
        if entry == name:
            if source == ADDED and _hf_listed(key):  # list_models() lists it as its hub cache repository
                return None
            return describe(name, path, source, _read_uses().get(str(key)))
    return None


def add_model(path: Path) -> LocalModel:
    """Register a GGUF file or model folder the user points at; it is listed from then on (never moved or copied)."""
    path = _key(Path(path).expanduser())
    if not _is_loadable(path):
        raise LibraryError(
            f"{shown_path(path)}: not a model mlxinfer can load; give a .gguf file or a folder with config.json "
            "and *.safetensors"
        )
    added = _read_added()
    if str(path) not in added:
        if len(added) >= MAX_ADDED:
            raise LibraryError(f"{_registry()}: already lists {MAX_ADDED} added models; `mlxinfer rm` some first")
        _write_json(_registry(), {"added": [*added, str(path)]}, LibraryError)
    return describe(_name(path), path, ADDED, _read_uses().get(str(path)))


def record_use(path: Path) -> None:
    """Note that `path` was just loaded; never raises (a read-only cache only loses the time, with a warning)."""
    uses = _read_uses()
    uses[str(_key(Path(path)))] = time.time()
    newest = dict(sorted(uses.items(), key=lambda kv: kv[1], reverse=True)[:MAX_USES])
    try:
        _write_json(cache_dir() / USES_FILE, newest, LibraryError)
    except LibraryError as e:
        log.warning("%s", e)


def remove_model(model: LocalModel) -> list[Path]:
    """Delete `model` and return what was deleted; an added model is only unregistered (its files are the user's).

    A models-folder or cache entry is deleted if it is still directly in that folder; a hub cache entry
    through huggingface_hub's own delete strategy (every revision of the repository).
    """
    if model.source == ADDED:
        added = _read_added()
        _write_json(_registry(), {"added": [p for p in added if p != str(_key(model.path))]}, LibraryError)
        return []
    if model.source == HF_CACHE:
        return _remove_hf_repo(model)
    parent = models_dir() if model.source == MODELS_DIR else cache_dir() / "models"
    if _key(model.path.parent) != _key(parent) or not _is_loadable(model.path):
        raise LibraryError(f"{shown_path(model.path)}: no longer a model in {shown_path(parent)}; nothing deleted")
    try:
        shutil.rmtree(model.path) if model.path.is_dir() and not model.path.is_symlink() else model.path.unlink()
    except OSError as e:
        raise LibraryError(f"{shown_path(model.path)}: cannot be deleted ({e.strerror or e})") from None
    return [model.path]


def describe(name: str, path: Path, source: str, last_used: float | None = None) -> LocalModel:
    """What `path` is, from its config.json or GGUF header; a file that cannot be read leaves fields None."""
    size, complete = disk_bytes(path)
    if path.suffix == ".gguf" and not path.is_dir():
        family, bits = gguf_facts(path)
        verified = _gguf_verified(family)
    else:
        raw = _config(path)
        family = plain(raw["model_type"]) if isinstance(raw.get("model_type"), str) else None
        verified, bits = _config_verified(raw, path), _config_bits(raw)
    return LocalModel(name, path, source, family, verified, bits, size, complete, last_used)


def loadable_family(raw: dict[str, Any], source: str) -> bool:
    """Whether mlxinfer runs this config.json as verified (True) or through mlx-lm's code (False); raises
    UnsupportedModelError / ConfigError, naming `source`, when it cannot run it at all."""
    from ..models.config import normalize_config

    return normalize_config(raw, source).verified


# -- where models are ---------------------------------------------------------------------


def _entries(only: str | None = None) -> Iterator[tuple[str, Path, str]]:
    """(name, path, source) of every model, in list_models() order, from folder listings only (no file is read
    but an added GGUF's magic). With `only`, the entries that cannot be called `only` may be left out: the hub
    cache is then looked into only for an "org/name" `only`, and only that repository's folder."""
    for folder, source in ((models_dir(), MODELS_DIR), (cache_dir() / "models", CACHE)):
        for path in local_models(folder):
            yield _name(path), path, source
    if only is None:
        yield from _hf_entries()
    elif "/" in only:
        yield from _hf_entry(only)
    for text in _read_added():
        path = Path(text)
        if only is not None and _name(path) != only:
            continue
        if _is_loadable(path):
            yield _name(path), path, ADDED
        else:
            log.warning("%s: an added model that is gone or unreadable; `mlxinfer rm` unregisters it", text)


def _hf_entries() -> Iterator[tuple[str, Path, str]]:
    """Each cached model repository's newest snapshot that holds config.json and *.safetensors."""
    info = _scan_hf_cache()
    for repo in sorted(info.repos if info else (), key=lambda r: r.repo_id):
        path = _hf_snapshot(repo)
        if path is not None:
            yield repo.repo_id, path, HF_CACHE


def _hf_snapshot(repo: Any) -> Path | None:
    """A cached model repository's newest snapshot that holds config.json and *.safetensors, or None."""
    if repo.repo_type != "model":
        return None
    snapshots = sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True)
    return next((r.snapshot_path for r in snapshots if _is_loadable(r.snapshot_path)), None)


def _hf_entry(repo_id: str) -> Iterator[tuple[str, Path, str]]:
    """What _hf_entries() yields for `repo_id`, from that one repository's cache folder (never a whole scan)."""
    org, _, name = repo_id.partition("/")
    if not org or not name or "/" in name or "--" in repo_id or repo_id.startswith(".") or not repo_id.isprintable():
        return  # not a name huggingface_hub's cache folders give
    root = hf_cache_dir()
    folder = root / f"models--{org}--{name}"
    try:
        if not folder.is_dir() or not _hf_cache_in_bounds(root):
            return
        from huggingface_hub.utils._cache_manager import _scan_cached_repo

        repo = _scan_cached_repo(folder)
    except ImportError:  # another huggingface_hub: the whole (bounded) scan
        yield from (entry for entry in _hf_entries() if entry[0] == repo_id)
        return
    except Exception as e:  # noqa: BLE001 - a broken cache entry is no model, as in scan_cache_dir
        log.warning("skipping %s in the Hugging Face cache: %s", shown_path(folder), first_line(e))
        return
    path = _hf_snapshot(repo) if repo.repo_id == repo_id else None
    if path is not None:
        yield repo_id, path, HF_CACHE


def _hf_listed(key: Path) -> bool:
    """Whether list_models() lists resolved path `key` (an added model) as a hub cache snapshot, before it."""
    root = _key(hf_cache_dir())
    try:
        parts = key.relative_to(root).parts
    except ValueError:
        return False
    repo = parts[0].split("--", 1) if parts else []
    if len(parts) != 3 or parts[1] != "snapshots" or len(repo) != 2 or repo[0] != "models":
        return False
    return any(_key(path) == key for _, path, _ in _hf_entry(repo[1].replace("--", "/")))


def _hf_cache_in_bounds(root: Path) -> bool:
    """At most MAX_HF_REPOS entries in the hub cache folder (a larger one is skipped, with a warning)."""
    with os.scandir(root) as listing:
        count = sum(1 for _ in zip(listing, range(MAX_HF_REPOS + 1)))
    if count > MAX_HF_REPOS:
        log.warning("skipping the Hugging Face cache %s: more than %d entries", shown_path(root), MAX_HF_REPOS)
    return count <= MAX_HF_REPOS


def _scan_hf_cache() -> Any:
    root = hf_cache_dir()
    try:
        if not root.is_dir() or not _hf_cache_in_bounds(root):
            return None
        from huggingface_hub import scan_cache_dir

        return scan_cache_dir(root)
    except Exception as e:  # noqa: BLE001 - a broken cache must not hide the other models
        log.warning("skipping the Hugging Face cache %s: %s", shown_path(root), first_line(e))
        return None


def _remove_hf_repo(model: LocalModel) -> list[Path]:
    info = _scan_hf_cache()
    repo = next((r for r in info.repos if r.repo_id == model.name and r.repo_type == "model"), None) if info else None
    if repo is None:
        raise LibraryError(f"{model.name}: no longer in the Hugging Face cache {shown_path(hf_cache_dir())}")
    try:
        info.delete_revisions(*(r.commit_hash for r in repo.revisions)).execute()
    except OSError as e:
        raise LibraryError(f"{repo.repo_path}: cannot be deleted ({e.strerror or e})") from None
    return [Path(repo.repo_path)]


def _name(path: Path) -> str:
    return path.stem if path.suffix == ".gguf" and not path.is_dir() else path.name


def _key(path: Path) -> Path:
    try:
        return path.resolve()
    except (OSError, RuntimeError):  # a link loop
        return path.absolute()


def _is_loadable(path: Path) -> bool:
    try:
        if path.is_file():
            with path.open("rb") as f:
                return path.suffix == ".gguf" and f.read(4) == b"GGUF"
        return (path / "config.json").is_file() and any(path.glob("*.safetensors"))
    except OSError:
        return False


# -- what a model is -------------------------------------------------------------------------


def _config(folder: Path) -> dict[str, Any]:
    try:
        return read_json_object(folder / "config.json", ConfigError, limit=MAX_CONFIG_BYTES)
    except ConfigError as e:
        log.warning("%s", e)
        return {}


def _config_verified(raw: dict[str, Any], path: Path) -> bool | None:
    if not raw:
        return None
    try:
        return loadable_family(raw, str(path / "config.json"))
    except (MlxInferError, TypeError, ValueError, KeyError, AttributeError):  # a listing never fails on one model
        return None


def _config_bits(raw: dict[str, Any]) -> int | None:
    for key in ("quantization", "quantization_config"):
        section = raw.get(key)
        if isinstance(section, dict) and is_int(section.get("bits")) and 0 < section["bits"] <= 32:
            return int(section["bits"])
    return _TORCH_DTYPE_BITS.get(str(raw.get("torch_dtype") or raw.get("dtype")))


def _gguf_verified(family: str | None) -> bool | None:
    from ..models.gguf_arch import ARCHITECTURES
    from ..models.registry import ARCHITECTURES as VERIFIED

    arch = ARCHITECTURES.get(family or "")
    return True if arch is not None and arch.model_type in VERIFIED else None


def gguf_facts(path: Path) -> tuple[str | None, int | None]:
    """general.architecture and the bits of general.file_type, from the first metadata keys of a GGUF file.

    Reads at most MAX_GGUF_KEYS keys (skipping arrays by their sizes) and stops once both are found, so a
    file's tokenizer arrays are never read; an unreadable or malformed header gives (None, None)."""
    found: dict[str, Any] = {}
    try:
        with path.open("rb") as f:
            if f.read(4) != b"GGUF" or _unpack(f, "<I") not in (2, 3):
                return None, None
            _unpack(f, "<Q")  # tensor count
            for _ in range(min(_unpack(f, "<Q"), MAX_GGUF_KEYS)):
                key, kind = _gguf_string(f), _unpack(f, "<I")
                found[key] = _gguf_value(f, kind)
                if "general.architecture" in found and "general.file_type" in found:
                    break
    except (OSError, ValueError, struct.error, UnicodeDecodeError):
        pass
    family = found.get("general.architecture")
    return (plain(family) if isinstance(family, str) else None), _file_type_bits(found.get("general.file_type"))


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def _unpack(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) < size:
        raise ValueError("the header ends early")
    return struct.unpack(fmt, data)[0]


def _gguf_string(f: BinaryIO) -> str:
    length = _unpack(f, "<Q")
    if length > MAX_GGUF_STRING:
        raise ValueError("a string longer than a header key or value can be")
    return f.read(length).decode("utf-8")


def _gguf_value(f: BinaryIO, kind: int) -> Any:
    if kind in _GGUF_SCALARS:
        return _unpack(f, _GGUF_SCALARS[kind])
    if kind == 8:
        return _gguf_string(f)
    if kind == 9:  # an array: skipped (the tokenizer's come after the general.* keys)
        item, count = _unpack(f, "<I"), _unpack(f, "<Q")
        if item in _GGUF_SCALARS:
            f.seek(count * struct.calcsize(_GGUF_SCALARS[item]), os.SEEK_CUR)
            return None
        if item == 8 and count <= MAX_GGUF_KEYS:  # general.languages, general.tags: a few strings
            for _ in range(count):
                f.seek(_unpack(f, "<Q"), os.SEEK_CUR)
            return None
        raise ValueError("a long array of strings, or of arrays, before the general.* keys")
    raise ValueError(f"unknown metadata type {kind}")


def _file_type_bits(file_type: Any) -> int | None:
    """Bits of llama.cpp's LLAMA_FTYPE: MOSTLY_Q4_1 -> 4, MOSTLY_Q8_0 -> 8, MOSTLY_F16 -> 16, ALL_F32 -> 32."""
    if not is_int(file_type):
        return None
    try:
        from gguf import LlamaFileType

        name = LlamaFileType(int(file_type)).name
    except (ImportError, ValueError):
        return None
    for marker, bits in (("F32", 32), ("F16", 16), ("BF16", 16)):
        if name.endswith(marker):
            return bits
    digits = name.split("Q")[-1][:1]  # MOSTLY_Q4_K_M, MOSTLY_IQ2_XS, MOSTLY_TQ1_0
    return int(digits) if digits.isdigit() else None


# -- the two small JSON files -----------------------------------------------------------------


def _registry() -> Path:
    return config_dir() / REGISTRY_FILE


def _read_added() -> list[str]:
    data = _read_state(_registry())
    added = data.get("added", [])
    if not isinstance(added, list) or not all(isinstance(p, str) and os.path.isabs(p) for p in added):
        log.warning("%s: 'added' must be a list of absolute paths; ignoring it", shown_path(_registry()))
        return []
    return list(dict.fromkeys(added))[:MAX_ADDED]


def _read_uses() -> dict[str, float]:
    data = _read_state(cache_dir() / USES_FILE)
    return {k: float(v) for k, v in data.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _read_state(path: Path) -> dict[str, Any]:
    """A small JSON object mlxinfer wrote; missing is empty, and corrupt is empty with a one-line warning."""
    if not path.exists():
        return {}
    try:
        return read_json_object(path, LibraryError, limit=MAX_STATE_BYTES)
    except LibraryError as e:
        log.warning("ignoring %s", e)
        return {}


def _write_json(path: Path, value: Any, error: type[MlxInferError]) -> None:
    """Write `value` to `path` atomically: a reader sees the old file or the new one, never half of one."""
    partial = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as f:
            partial = f.name
            json.dump(value, f, indent=1)
        os.replace(partial, path)
    except OSError as e:
        if partial is not None:
            with contextlib.suppress(OSError):
                os.unlink(partial)
        raise error(f"{shown_path(path)}: cannot be written ({e.strerror or e})") from None


# -- what `mlxinfer show` prints -------------------------------------------------------------

MAX_TEMPLATE_LINES = 5


def details(model: LocalModel) -> dict[str, Any]:
    """A model's config summary: family, sizes, context, chat template and quantization; nothing is loaded.

    Example:
        >>> details(find_model("SmolLM2-4bit"))["quantization"]
        {'bits': 4, 'group_size': 64, 'mode': 'affine'}
    """
    if model.path.suffix == ".gguf" and not model.path.is_dir():
        config, template, quantization = _gguf_details(model.path)
    else:
        config, template, quantization = _folder_details(model.path)
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
    }


def _folder_details(folder: Path) -> tuple[dict[str, Any], str | None, dict[str, Any] | None]:
    config = _config(folder)
    section = config.get("quantization") or config.get("quantization_config")
    quantization = None
    if isinstance(section, dict):
        mode = section.get("mode") or section.get("quant_method") or "affine"
        quantization = {"bits": section.get("bits"), "group_size": section.get("group_size"), "mode": mode}
        quantization = {k: v if isinstance(v, (int, str)) else None for k, v in quantization.items()}
    return config, chat_template(folder), quantization


MAX_TEMPLATE_BYTES = 1 << 20  # a chat template file or GGUF value; real ones are a few KB (the largest ~100 KB)
MAX_TOKENIZER_CONFIG_BYTES = 64 << 20  # tokenizer_config.json: its added_tokens_decoder can take megabytes
MAX_GGUF_ALL_KEYS = 1 << 16  # metadata keys walked looking for tokenizer.chat_template
MAX_GGUF_ITEMS = 1 << 24  # items in one metadata array (a vocabulary: ~10^5)


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
    """tokenizer.chat_template from a GGUF header: keys are walked (arrays skipped by their sizes, at most
    MAX_GGUF_ALL_KEYS keys) until it is found; a malformed header gives None."""
    try:
        with path.open("rb") as f:
            if f.read(4) != b"GGUF" or _unpack(f, "<I") not in (2, 3):
                return None
            _unpack(f, "<Q")  # tensor count
            for _ in range(min(_unpack(f, "<Q"), MAX_GGUF_ALL_KEYS)):
                key, kind = _gguf_string(f), _unpack(f, "<I")
                if key == "tokenizer.chat_template":
                    if kind != 8:
                        return None
                    length = _unpack(f, "<Q")
                    return f.read(length).decode("utf-8") if length <= MAX_TEMPLATE_BYTES else None
                _skip_gguf_value(f, kind)
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as e:
        log.warning("%s: no chat template read from its header (%s)", shown_path(path), first_line(e))
    return None


def _skip_gguf_value(f: BinaryIO, kind: int, depth: int = 0) -> None:
    if kind in _GGUF_SCALARS:
        f.seek(struct.calcsize(_GGUF_SCALARS[kind]), os.SEEK_CUR)
    elif kind == 8:
        f.seek(_unpack(f, "<Q"), os.SEEK_CUR)
    elif kind == 9 and depth < 2:
        item, count = _unpack(f, "<I"), _unpack(f, "<Q")
        if count > MAX_GGUF_ITEMS:
            raise ValueError(f"an array of {count} items")
        if item in _GGUF_SCALARS:
            f.seek(count * struct.calcsize(_GGUF_SCALARS[item]), os.SEEK_CUR)
        else:
            for _ in range(count):
                _skip_gguf_value(f, item, depth + 1)
    else:
        raise ValueError(f"metadata type {kind} cannot be skipped")


def _gguf_details(path: Path) -> tuple[dict[str, Any], str | None, dict[str, Any] | None]:
    from ..formats.gguf_file import GGUFFile
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
        return {}, None, None
    template = metadata.get("tokenizer.chat_template")
    _, bits = gguf_facts(path)
    file_type = metadata.get("general.file_type")
    name = None
    with contextlib.suppress(ImportError, ValueError, TypeError):
        from gguf import LlamaFileType

        name = LlamaFileType(int(file_type)).name
    group = 32 if name and any(q in name for q in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")) else None
    quantization = {"bits": bits, "group_size": group, "mode": f"gguf {name}" if name else "gguf"}
    return config, template if isinstance(template, str) else None, quantization
