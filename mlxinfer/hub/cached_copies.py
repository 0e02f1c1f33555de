"""The Hugging Face cache, read only: a listed file that another tool already downloaded is not fetched again.

pull copies such a file into its download folder and checks it like a download (size, then sha256 or git blob
id); `convert ORG/NAME` reads a complete snapshot where it is. Nothing here writes to that cache or goes online:
huggingface_hub's try_to_load_from_cache only looks at the folder.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

from ..library import hf_cache_dir
from .repo import Listing, RemoteFile


def hf_cache_file(listing: Listing, remote: RemoteFile) -> Path | None:
    """`remote` as the Hugging Face cache holds it for the listed commit, if it is a file of the listed size."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(listing.repo_id, remote.name, hf_cache_dir(), revision=listing.commit)
    except (OSError, ValueError):  # an unreadable cache folder is no copy: the file is downloaded
        return None
    if not isinstance(found, str):  # None, or huggingface_hub's marker for a file the Hub said is absent
        return None
    path = Path(found)
    try:
        info = path.stat()  # through the snapshot's link to its blob, as huggingface_hub lays the cache out
    except OSError:
        return None
    return path if stat.S_ISREG(info.st_mode) and info.st_size == remote.size else None


def hf_cache_snapshot(listing: Listing, files: tuple[RemoteFile, ...]) -> Path | None:
    """The Hugging Face cache's folder for the listed commit, if it holds every one of `files`; None otherwise."""
    folders = set()
    for remote in files:
        path = hf_cache_file(listing, remote)
        if path is None:
            return None
        folders.add(path.parent)
    return folders.pop() if len(folders) == 1 else None  # every listed file is top-level: one snapshot folder


def open_regular(path: Path) -> BinaryIO:
    """`path` opened for reading if it is a regular file (links followed: the cache's snapshots are links);
    OSError otherwise. O_NONBLOCK keeps a named pipe put there from holding the open."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path}: not a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
