"""The download folder on disk: made, read, written and cleared without ever following a link.

The downloads root (MLXINFER_CACHE_DIR/downloads) may itself be a link, say to another disk; below it no link is
followed, as in the prefix store and the converter. Each folder is checked to be a folder, not a link, before it is
used; files are opened with O_NOFOLLOW and must be plain files with one link (writing to a hard link would write
another file too); only folders checked that way are deleted. A link or anything else found there stops the pull
with one line naming it: it is the user's to remove, never ours to touch.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

from ..errors import HubError
from ..untrusted import shown_path

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # opening a FIFO planted there must not block
_MODES = {"rb": os.O_RDONLY, "wb": os.O_WRONLY | os.O_CREAT, "ab": os.O_WRONLY | os.O_CREAT | os.O_APPEND}


def own_folder(root: Path, names: Sequence[str], create: bool = False) -> Path | None:
    """root/names[0]/names[1]/..., each below `root` a folder and not a link (made if missing and `create`);
    None if one is missing. `root` may be a link."""
    if create:
        root.mkdir(parents=True, exist_ok=True)
    path = root
    for name in names:
        path = path / name
        if create:
            with contextlib.suppress(FileExistsError):  # mkdir never follows a link: one there is found below
                path.mkdir()
        try:
            info = path.lstat()
        except FileNotFoundError:
            return None
        if not stat.S_ISDIR(info.st_mode):
            raise _refused(path, "is a link" if stat.S_ISLNK(info.st_mode) else "is not a folder")
    return path


def own_file(path: Path) -> os.stat_result | None:
    """`path`'s lstat if it is a plain file with one link, None if there is nothing; refused if anything else.
    Its folder must have been checked with own_folder."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return None
    _check_file(path, info)
    return info


def open_own(path: Path, mode: str) -> BinaryIO:
    """`path` opened for `mode` ("rb", "wb": made or emptied, "ab": made or appended to), never through a link and
    only if a plain file with one link. OSError as open() raises it."""
    fd = os.open(path, _MODES[mode] | _NOFOLLOW | _NONBLOCK, 0o644)
    try:
        _check_file(path, os.fstat(fd))  # the file opened, not a name: a swap after a check cannot slip by
        if mode == "wb":
            os.ftruncate(fd, 0)  # only now: O_TRUNC would empty a hard-linked file before the check
        return os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        raise


def remove_own_folder(path: Path) -> None:
    """Delete the folder `path` and what it holds, unless it is a link (rmtree never follows one inside it)."""
    with contextlib.suppress(OSError):
        if stat.S_ISDIR(path.lstat().st_mode):
            shutil.rmtree(path, ignore_errors=True)


def _check_file(path: Path, info: os.stat_result) -> None:
    if stat.S_ISLNK(info.st_mode):
        raise _refused(path, "is a link")
    if not stat.S_ISREG(info.st_mode):
        raise _refused(path, "is not a plain file")
    if info.st_nlink > 1:
        raise _refused(path, f"has {info.st_nlink} hard links, so writing it would write another file too")


def _refused(path: Path, what: str) -> HubError:
    return HubError(
        f"{shown_path(path)}: {what}; pull never reads, writes or deletes through a link in its download folder: "
        "remove it, then run the same pull again"
    )
