"""Models on this machine that mlxinfer can load: MLX or Hugging Face folders and GGUF files in a folder."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ..formats.gguf_file import is_gguf

log = logging.getLogger(__name__)

MAX_ENTRIES = 10_000  # files and folders disk_bytes looks at in one model folder


def models_dir() -> Path:
    """Where converted models live: $MLXINFER_MODELS_DIR, else ~/models (what the README's examples use)."""
    override = os.environ.get("MLXINFER_MODELS_DIR")
    return Path(override).expanduser() if override else Path.home() / "models"


def local_models(folder: Path | None = None) -> list[Path]:
    """Loadable models directly inside `folder` (default: models_dir()), sorted by name.

    None if it is missing; an unreadable folder is skipped with a warning naming it, so
    `cache ls` still lists the other folders and the menubar's Switch Model menu still opens.
    """
    folder = folder or models_dir()
    try:
        if not folder.is_dir():
            return []
        found = [p for p in folder.iterdir() if is_loadable(p, read_magic=False)]
    except OSError as e:
        log.warning("skipping models folder %s: %s", folder, e.strerror or e)
        return []
    return sorted(found, key=lambda p: p.name.lower())


def disk_bytes(path: Path, max_entries: int = MAX_ENTRIES) -> tuple[int, bool]:
    """Bytes a model takes on disk (a file's size, or the sum of a folder's files) and whether all were counted.

    A linked file counts as its target (a folder of links into the Hugging Face cache is
    that big); linked folders are not entered, so the walk stays inside `path` and ends. It
    stops after `max_entries` entries: a model folder holds a few dozen files.

    Example:
        >>> size, complete = disk_bytes(models_dir() / "SmolLM2-4bit")
    """
    if not path.is_dir():
        return _size(path), True
    total, seen, folders = 0, 0, [path]
    while folders:
        try:
            with os.scandir(folders.pop()) as listing:
                for entry in listing:  # one entry at a time: a folder of millions stops at the limit
                    seen += 1
                    if seen > max_entries:
                        return total, False
                    if entry.is_dir(follow_symlinks=False):
                        folders.append(Path(entry.path))
                    elif not entry.is_dir():  # a file, or a link to one (a link to a folder is skipped)
                        total += _size(Path(entry.path))
        except OSError:  # unreadable: count what can be read
            continue
    return total, True


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:  # a dangling link, a file removed meanwhile
        return 0


def is_loadable(path: Path, *, read_magic: bool = True) -> bool:
    """A .gguf file or a folder with config.json and *.safetensors. With `read_magic` (a path the user gave, a hub
    snapshot) a .gguf file must also start with GGUF's magic; a folder listing skips that read to stay cheap."""
    try:
        if path.is_file():
            return path.suffix == ".gguf" and (not read_magic or is_gguf(path))
        return (path / "config.json").is_file() and any(path.glob("*.safetensors"))
    except OSError:  # an entry that cannot be looked into is not one mlxinfer could load
        return False


ADAPTER_CONFIG = "adapter_config.json"  # a LoRA/DoRA adapter folder (mlx-lm's or PEFT's), not a model


def local_adapters(folder: Path | None = None) -> list[Path]:
    """Adapter folders directly inside `folder` (default: models_dir()), sorted by name: a server loads one when a
    request names `MODEL:ADAPTER`."""
    folder = folder or models_dir()
    try:
        found = [p for p in folder.iterdir() if _is_adapter(p)] if folder.is_dir() else []
    except OSError as e:
        log.warning("skipping models folder %s: %s", folder, e.strerror or e)
        return []
    return sorted(found, key=lambda p: p.name.lower())


def find_adapter(name: str) -> Path | None:
    """The adapter folder called `name` in the models folder, or None (a name is one plain path component)."""
    if not name or name.startswith(".") or Path(name).name != name:
        return None
    path = models_dir() / name
    return path if _is_adapter(path) else None


def _is_adapter(path: Path) -> bool:
    try:
        return path.is_dir() and (path / ADAPTER_CONFIG).is_file() and not (path / "config.json").exists()
    except OSError:
        return False


def model_name(path: Path) -> str:
    """What a model at `path` is called: a GGUF file's stem, or the folder's name."""
    return path.stem if path.suffix == ".gguf" and not path.is_dir() else path.name


def resolved(path: Path) -> Path:
    """`path` with its links resolved: the one key a model has however it is reached."""
    try:
        return path.resolve()
    except (OSError, RuntimeError):  # a link loop
        return path.absolute()
