"""The local models every front end lists (`mlxinfer ls`, the menubar's Switch Model, the server's model names).

Four places, in this order: the models folder (catalog.models_dir()), mlxinfer's own cache (the default model), the
Hugging Face hub cache and files or folders the user added (state.py's registry). A path is listed once, under
the first name it is found by; each model is described from its side files only (local_model.py).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

from ..errors import LibraryError
from ..paths import cache_dir
from ..untrusted import shown_path
from .catalog import is_loadable, local_models, model_name, models_dir, resolved
from .hf_cache import cached_model, cached_models, lists_snapshot, remove_repo
from .local_model import ADDED, CACHE, HF_CACHE, MODELS_DIR, LocalModel, describe
from .state import MAX_ADDED, read_added, read_uses, registry, write_added

log = logging.getLogger(__name__)


def list_models() -> list[LocalModel]:
    """Every model mlxinfer can find: models folder, its cache, the hub cache, then added ones; a path once.

    Example:
        >>> [(m.name, m.support, m.bits) for m in list_models()]
        [('SmolLM2-4bit', 'verified', 4), ('Qwen/Qwen3-0.6B', 'verified', 16)]
    """
    uses = read_uses()
    seen: set[Path] = set()
    found = []
    for name, path, source in _entries():
        key = resolved(path)
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
        key = resolved(path)
        if key in seen:  # as list_models(): a path once, under the name it was first listed with
            continue
        seen.add(key)
        if entry == name:
            if source == ADDED and lists_snapshot(key):  # list_models() lists it as its hub cache repository
                return None
            return describe(name, path, source, read_uses().get(str(key)))
    return None


def located(model: str | Path) -> Path:
    """`model` as a path where one exists there, else the path of the model `mlxinfer ls` lists by that name (a
    folder in the models folder, an org/name in the Hugging Face cache, an added file), else `model` as a path (the
    loader then says it is none): what lets every command take a name as well as a path."""
    path = Path(model).expanduser()
    if path.exists() or not isinstance(model, str):
        return path
    found = find_model(model)
    return found.path if found is not None else path


def add_model(path: Path) -> LocalModel:
    """Register a GGUF file or model folder the user points at; it is listed from then on (never moved or copied)."""
    path = resolved(Path(path).expanduser())
    if not is_loadable(path):
        raise LibraryError(
            f"{shown_path(path)}: not a model mlxinfer can load; give a .gguf file or a folder with config.json "
            "and *.safetensors"
        )
    added = read_added()
    if str(path) not in added:
        if len(added) >= MAX_ADDED:
            raise LibraryError(f"{registry()}: already lists {MAX_ADDED} added models; `mlxinfer rm` some first")
        write_added([*added, str(path)])
    return describe(model_name(path), path, ADDED, read_uses().get(str(path)))


def remove_model(model: LocalModel) -> list[Path]:
    """Delete `model` and return what was deleted; an added model is only unregistered (its files are the user's).

    A models-folder or cache entry is deleted if it is still directly in that folder; a hub cache entry
    through huggingface_hub's own delete strategy (every revision of the repository).
    """
    if model.source == ADDED:
        write_added([p for p in read_added() if p != str(resolved(model.path))])
        return []
    if model.source == HF_CACHE:
        return remove_repo(model.name)
    parent = models_dir() if model.source == MODELS_DIR else cache_dir() / "models"
    if resolved(model.path.parent) != resolved(parent) or not is_loadable(model.path):
        raise LibraryError(f"{shown_path(model.path)}: no longer a model in {shown_path(parent)}; nothing deleted")
    try:
        shutil.rmtree(model.path) if model.path.is_dir() and not model.path.is_symlink() else model.path.unlink()
    except OSError as e:
        raise LibraryError(f"{shown_path(model.path)}: cannot be deleted ({e.strerror or e})") from None
    return [model.path]


def _entries(only: str | None = None) -> Iterator[tuple[str, Path, str]]:
    """(name, path, source) of every model, in list_models() order, from folder listings only (no file is read
    but an added GGUF's magic). With `only`, the entries that cannot be called `only` may be left out: the hub
    cache is then looked into only for an "org/name" `only`, and only that repository's folder."""
    for folder, source in ((models_dir(), MODELS_DIR), (cache_dir() / "models", CACHE)):
        for path in local_models(folder):
            yield model_name(path), path, source
    if only is None:
        yield from ((repo_id, path, HF_CACHE) for repo_id, path in cached_models())
    elif "/" in only and (path := cached_model(only)) is not None:
        yield only, path, HF_CACHE
    for text in read_added():
        path = Path(text)
        if only is not None and model_name(path) != only:
            continue
        if is_loadable(path):
            yield model_name(path), path, ADDED
        else:
            log.warning("%s: an added model that is gone or unreadable; `mlxinfer rm` unregisters it", text)
