"""A model copied under a new name into the models folder (Ollama's `cp`, /api/copy).

The copy shares the source's files where the file system allows (hard links: instant, no space taken, and a
later delete of either leaves the other whole; mlxinfer never writes into a model's files), else copies them
after checking the space. It is made out of sight (a hidden folder in the models folder, which the listing
never reads) and moved into place in one step that never replaces anything.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

from ..errors import LibraryError
from ..untrusted import shown, shown_path
from .catalog import disk_bytes, models_dir
from .local_model import LocalModel

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")  # one path component: no separators, no leading dot
HEADROOM = 1.05  # more than the copy's own bytes free, for the file system's own blocks


def copy_model(model: LocalModel, name: str) -> Path:
    """Copy `model` to `name` in the models folder and return the new path; refuses a name already taken."""
    if not isinstance(name, str) or not NAME.fullmatch(name) or name.endswith(".gguf"):
        raise LibraryError(f"{shown(name)} is not a model name: use letters, digits, '.', '_' or '-' (no .gguf)")
    folder = models_dir()
    single = model.path.is_file()
    target = folder / (f"{name}.gguf" if single else name)
    if target.exists() or (folder / name).exists():
        raise LibraryError(f"{shown_path(target)} exists already; nothing is replaced: choose another name")
    folder.mkdir(parents=True, exist_ok=True)
    hidden = Path(tempfile.mkdtemp(prefix=".copying-", dir=folder))
    try:
        made = hidden / target.name
        if single:
            _link_or_copy(model.path, made, folder)
        else:
            shutil.copytree(model.path, made, copy_function=lambda s, d: _link_or_copy(Path(s), Path(d), folder))
        _place(made, target)
    except OSError as e:
        raise LibraryError(f"{shown_path(target)}: the copy failed ({e.strerror or e}); nothing was added") from None
    finally:
        shutil.rmtree(hidden, ignore_errors=True)  # the hidden folder is this function's own
    return target


def _link_or_copy(source: Path, target: Path, folder: Path) -> None:
    real = source.resolve()  # a Hugging Face snapshot's files are links into its blobs
    try:
        os.link(real, target)
        return
    except OSError:  # another file system, or one without hard links: a real copy, if it fits
        pass
    size, _ = disk_bytes(real)
    free = shutil.disk_usage(folder).free
    if size * HEADROOM > free:
        raise LibraryError(f"{shown_path(folder)}: copying {real.name} needs {size:,} bytes, {free:,} are free")
    shutil.copy2(real, target)


def _place(made: Path, target: Path) -> None:
    """Move the finished copy to `target` without ever replacing what is there (another copy could have taken the
    name meanwhile): a file by a new link, a folder into the empty folder this function claims first."""
    if made.is_file():
        os.link(made, target)  # fails if the name exists
        return
    os.mkdir(target)  # fails if the name exists; then only an empty folder of our own is replaced
    try:
        os.replace(made, target)
    except OSError:
        os.rmdir(target)
        raise
