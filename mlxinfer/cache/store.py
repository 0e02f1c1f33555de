"""Warmed prefixes on disk, so a restart does not lose a system prompt's KV: the folders that hold them.

One file per prefix (its format and checks: prefix_file.py). Files live in a
folder per fingerprint (the weights, tokenizer, chat template, compute dtype
and cache format), so a changed model never reads another model's KV. Writes go
to a unique temporary file renamed into place: two processes warming the same
prefix each leave a whole file. A file of ours that fails its checks is moved to
`quarantine/` with a warning; the prompt is then prefilled as if nothing was cached.

The cache only ever touches what it wrote: a file whose name has our pattern,
whose header says it is an mlxinfer prefix, that is a regular file with one
link. Everything else (other names, other files, links, folders) is left alone.
The root (MLXINFER_CACHE_DIR/prefixes) may itself be a link, say to another
disk; below it no link is followed: folders and files are opened relative to
their parent's descriptor with O_NOFOLLOW, so a fingerprint folder or
`quarantine/` that is a link is never entered, moved into or deleted from.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import shutil
import stat
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from .. import disk
from ..display import mib
from ..errors import CacheError
from ..untrusted import plain, shown_path
from .prefix_file import (
    FORMAT,
    KVLayout,
    LayerState,
    NotOurs,
    Snapshots,
    encode,
    file_name,
    read_header,
    read_index,
    read_kv,
    token_count,
)

log = logging.getLogger(__name__)

SAMPLE_BYTES = 1 << 20  # per sampled region of a weight file
QUARANTINE = "quarantine"
MAX_FILES = 1024  # prefixes read at start-up; beyond this a folder is not what warm makes
MAX_WRITE = 1 << 30  # per os.write call: macOS refuses more than 2 GiB at once
_PREFIX_NAME = re.compile(r"[0-9a-f]{32}\.safetensors")
_TEMP_NAME = re.compile(r"\.([0-9a-f]{32}|probe)\.\d+\.[0-9a-f]{8}\.safetensors")  # unfinished writes, probes
_FOLDER_NAME = re.compile(r"[0-9a-f]{24}")
_FOLDER_FILES = re.compile(f"{_PREFIX_NAME.pattern}|{_TEMP_NAME.pattern}")  # what clear removes there
_QUARANTINED_NAME = re.compile(r"[0-9a-f]{24}-[0-9a-f]{32}(\.[0-9a-f]{8})?\.safetensors")
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
_ELSEWHERE = "point MLXINFER_CACHE_DIR elsewhere"


@dataclass(frozen=True)
class StoredPrefix:
    path: Path
    token_ids: tuple[int, ...]
    nbytes: int  # of its arrays, once loaded
    snapshots: tuple[int, ...] = ()  # positions of its state snapshots (a model with uncuttable layers)


_Found = tuple[Path, str, os.stat_result, dict]  # a file of ours: folder, name, stat, metadata


def fingerprint(weight_files: Iterable[Path], *parts: str) -> str:
    """A short hash of the model files (sizes and sampled contents) and of `parts` (tokenizer, template, dtype...).

    Sampling the start, middle and end of each file keeps this instant for
    multi-GB weights while any re-conversion or different download changes it.
    """
    digest = hashlib.sha256(FORMAT.encode())
    for file in sorted(f for f in weight_files if f.is_file()):  # not a FIFO or device: opening one can block
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with file.open("rb") as f:
            for offset in sorted({0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)}):
                f.seek(offset)
                digest.update(f.read(SAMPLE_BYTES))
    for part in parts:
        digest.update(hashlib.sha256(part.encode()).digest())
    return digest.hexdigest()[:24]


class PrefixStore:
    """The on-disk prefixes of one model fingerprint under `root`."""

    def __init__(self, root: Path, model_fingerprint: str, layout: KVLayout, label: str = ""):
        self.root = Path(root)
        self.fingerprint = model_fingerprint
        self.folder = self.root / model_fingerprint
        self.layout = layout
        self.label = label  # the model's name, for `mlxinfer cache ls`
        self._verified: dict[str, tuple[int, ...]] = {}  # file name -> identity of the file that hashed right

    def check_room(self, tokens: int) -> None:
        """Raise CacheError now if a `tokens`-long prefix cannot be written, before minutes of prefill."""
        needed = self.layout.file_bytes(tokens)
        try:
            with self._folder(create=True) as (_, folder):
                free = shutil.disk_usage(self.folder).free
                limit = disk.file_size_limit()
                if free < needed:
                    raise CacheError(
                        f"{shown_path(self.folder)}: {mib(free)} free but a {tokens}-token prefix takes {mib(needed)}; "
                        "free some space or point MLXINFER_CACHE_DIR at a disk with room"
                    )
                if limit is not None and needed > limit:
                    raise CacheError(
                        f"{shown_path(self.folder)}: a {tokens}-token prefix takes {mib(needed)}, over this process's "
                        f"file-size limit of {mib(limit)} (ulimit -f); raise it or warm a shorter prefix"
                    )
                self._write_atomically(folder, None, [])
        except OSError as e:
            raise self._unwritable(e) from None

    def save(self, token_ids: Sequence[int], layers: Sequence[LayerState | None],
             snapshots: Snapshots | None = None) -> Path:  # fmt: skip
        """Write one prefix atomically with the checksum of its tensors; returns its path.

        `layers`: the full-attention layers' arrays (None for the others); `snapshots`: the
        others' state at each position the prefix can resume from (None if the model has none)."""
        chunks = encode(token_ids, layers, snapshots, self.layout, self.fingerprint, self.label)
        name = file_name(token_ids)
        try:
            with self._folder(create=True) as (_, folder):
                self._write_atomically(folder, name, chunks)
        except OSError as e:
            raise self._unwritable(e) from None
        return self.folder / name

    def scan(self) -> list[StoredPrefix]:
        """Every stored prefix's token ids (the KV itself stays on disk until a hit); never raises."""
        try:
            with self._folder() as (_, folder):
                names = sorted(e.name for e in os.scandir(folder) if _PREFIX_NAME.fullmatch(e.name))
                if len(names) > MAX_FILES:
                    log.warning("%s holds %d prefixes; using the first %d", self.folder, len(names), MAX_FILES)
                found = [self._scan_one(folder, name) for name in names[:MAX_FILES]]
        except FileNotFoundError:
            return []  # nothing warmed yet
        except OSError as e:
            log.warning("not using the warmed prefixes in %s (%s)", self.folder, _why(e))
            return []
        return [stored for stored in found if stored is not None]

    def load(self, stored: StoredPrefix) -> tuple[list[LayerState | None], Snapshots | None] | None:
        """The KV of a stored prefix and its snapshots, or None (and the file quarantined if ours) if it does
        not check out."""
        identity, name = None, stored.path.name
        try:
            with self._folder() as (_, folder), _open_file(folder, name) as (f, st):
                identity = (st.st_dev, st.st_ino)
                # The same file as last time (a reload after eviction) is read again but not hashed again.
                same = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
                verified = self._verified.pop(name, None) == same
                found = read_kv(stored.path, f, st.st_size, stored.token_ids, stored.snapshots, self.fingerprint,
                                self.layout, verified)  # fmt: skip
                self._verified[name] = same
                return found
        except NotOurs as e:
            log.warning("leaving %s alone and not using it: %s", stored.path, e)
            return None
        except CacheError as e:
            self._quarantine(stored.path.name, e, identity)
            return None
        except OSError as e:
            log.warning("not using prefix cache file %s (%s)", stored.path, _why(e))
            return None

    def _scan_one(self, folder: int, name: str) -> StoredPrefix | None:
        path, identity = self.folder / name, None
        try:
            with _open_file(folder, name) as (f, st):
                identity = (st.st_dev, st.st_ino)
                ids, positions = read_index(path, f, read_header(f, st.st_size), self.fingerprint, self.layout)
        except NotOurs as e:
            log.warning("leaving %s alone: %s", path, e)
            return None
        except CacheError as e:
            self._quarantine(name, e, identity)
            return None
        except OSError as e:
            log.warning("not using prefix cache file %s (%s)", path, _why(e))
            return None
        return StoredPrefix(path, ids, self.layout.data_bytes(len(ids), positions) - 4 * len(ids), positions)

    @contextlib.contextmanager
    def _folder(self, create: bool = False) -> Iterator[tuple[int, int]]:
        """Descriptors of the root (which may be a link) and of this fingerprint's folder (which may not)."""
        if create:
            os.makedirs(self.root, exist_ok=True)
        with _open_dir(self.root, None, follow=True) as root:
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(self.fingerprint, 0o755, dir_fd=root)
            with _open_dir(self.fingerprint, root) as folder:
                yield root, folder

    def _write_atomically(self, folder: int, name: str | None, chunks: list[bytes | memoryview]) -> None:
        """Write to a unique temporary file in `folder`, then rename it to `name` (None: a probe, removed)."""
        stem = name.split(".")[0] if name else "probe"
        temporary = f".{stem}.{os.getpid()}.{uuid.uuid4().hex[:8]}.safetensors"
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644, dir_fd=folder)
            try:
                for chunk in chunks:
                    _write_all(fd, chunk)
            finally:
                os.close(fd)
            if name is not None:
                os.replace(temporary, name, src_dir_fd=folder, dst_dir_fd=folder)
        finally:
            with contextlib.suppress(OSError):  # gone after the rename; a read-only folder never had it
                os.unlink(temporary, dir_fd=folder)

    def _unwritable(self, e: OSError) -> CacheError:
        where, why = shown_path(self.folder), _why(e)
        return CacheError(f"cannot write warmed prefixes to {where}: {why}; {disk.remedy(e, _ELSEWHERE)}")

    def _quarantine(self, name: str, reason: Exception, identity: tuple[int, int] | None) -> None:
        """Move our file `name` to quarantine/ within the root; if that cannot be done safely, leave it."""
        try:
            with self._folder() as (root, folder):
                with contextlib.suppress(FileExistsError):
                    os.mkdir(QUARANTINE, 0o755, dir_fd=root)
                with _open_dir(QUARANTINE, root) as quarantine:
                    st = os.stat(name, dir_fd=folder, follow_symlinks=False)
                    if identity is None or (st.st_dev, st.st_ino) != identity:
                        raise NotOurs("it changed since it was read")
                    os.replace(name, self._quarantine_name(quarantine, name), src_dir_fd=folder, dst_dir_fd=quarantine)
        except (OSError, NotOurs) as e:
            why = _why(e) if isinstance(e, OSError) else str(e)
            log.warning("ignoring prefix cache file %s; left in place, not quarantined: %s", reason, why)
            return
        log.warning("ignoring prefix cache file %s; moved to quarantine/", reason)

    def _quarantine_name(self, quarantine: int, name: str) -> str:
        """`<fingerprint>-<name>`, with a unique suffix if that is taken: a rename never replaces anything."""
        target = f"{self.fingerprint}-{name}"
        with contextlib.suppress(FileNotFoundError):
            os.stat(target, dir_fd=quarantine, follow_symlinks=False)
            return f"{self.fingerprint}-{name.split('.')[0]}.{uuid.uuid4().hex[:8]}.safetensors"
        return target


def list_prefixes(root: Path) -> list[dict[str, object]]:
    """What `mlxinfer cache ls` shows: each stored prefix of ours with its model, tokens and size, from headers."""
    rows = []
    for folder, name, st, metadata in _our_files(Path(root), set_aside=False):
        tokens = token_count(metadata.get("tokens"))
        rows.append(
            {
                "model": plain(metadata.get("model", "?")),
                "tokens": "?" if tokens is None else tokens,
                "bytes": st.st_size,
                "path": folder / name,
            }
        )
    return rows


def clear_prefixes(root: Path) -> list[Path]:
    """Delete every file the cache wrote (prefixes, quarantined and unfinished ones); returns those removed.

    Anything else under `root` is left where it is, with a warning."""
    root, removed = Path(root), []
    for folder, name, _, _ in _our_files(root, set_aside=True, unlink=True):
        removed.append(folder / name)
    with contextlib.suppress(OSError), _open_dir(root, None, follow=True) as root_fd:
        for entry in os.scandir(root_fd):
            if _FOLDER_NAME.fullmatch(entry.name) or entry.name == QUARANTINE:
                with contextlib.suppress(OSError):  # only empty folders go; rmdir never follows a link
                    os.rmdir(entry.name, dir_fd=root_fd)
    return removed


def _our_files(root: Path, set_aside: bool, unlink: bool = False) -> Iterator[_Found]:
    """Each prefix file under `root` that the cache wrote (`set_aside`: also quarantined and unfinished ones).

    With `unlink`, each is removed before it is yielded, through its folder's descriptor, and
    everything else is reported as left alone."""
    try:
        with _open_dir(root, None, follow=True) as root_fd:
            folders = sorted(e.name for e in os.scandir(root_fd))
            for folder_name in folders:
                pattern = _folder_pattern(folder_name, set_aside)
                if pattern is None:
                    _left_alone(root / folder_name, "not made by the cache", unlink)
                    continue
                yield from _our_files_in(root, root_fd, folder_name, pattern, unlink)
    except FileNotFoundError:
        return
    except OSError as e:
        where = shown_path(root)
        raise CacheError(f"cannot read the prefix cache {where}: {_why(e)}; check MLXINFER_CACHE_DIR") from None


def _our_files_in(root: Path, root_fd: int, folder_name: str, pattern: re.Pattern, unlink: bool) -> Iterator[_Found]:
    folder_path = root / folder_name
    try:
        with _open_dir(folder_name, root_fd) as folder:
            for name in sorted(e.name for e in os.scandir(folder)):
                try:
                    if not pattern.fullmatch(name):
                        raise NotOurs("not a name the cache writes")
                    with _open_file(folder, name) as (f, st):
                        # An empty unfinished write or probe (left by a kill) has no header to say it is ours.
                        empty_temp = unlink and st.st_size == 0 and _TEMP_NAME.fullmatch(name)
                        metadata = {} if empty_temp else read_header(f, st.st_size).metadata
                    if unlink:
                        _unlink_same(folder, name, st)
                    yield folder_path, name, st, metadata
                except NotOurs as e:
                    _left_alone(folder_path / name, str(e), unlink)
                except OSError as e:
                    _left_alone(folder_path / name, _why(e), unlink)
    except OSError as e:
        _left_alone(folder_path, _why(e), unlink)


def _folder_pattern(name: str, set_aside: bool) -> re.Pattern | None:
    """The names the cache writes in root/`name`, or None for a folder it does not make."""
    if _FOLDER_NAME.fullmatch(name):
        return _FOLDER_FILES if set_aside else _PREFIX_NAME
    if name == QUARANTINE and set_aside:
        return _QUARANTINED_NAME
    return None


def _left_alone(path: Path, why: str, report: bool) -> None:
    if report:
        log.warning("left %s alone: %s", path, why)


def _unlink_same(folder: int, name: str, st: os.stat_result) -> None:
    """Remove `name` only if it is still the file that was checked (a swap in between is left alone)."""
    now = os.stat(name, dir_fd=folder, follow_symlinks=False)
    if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
        raise NotOurs("it changed while being checked")
    os.unlink(name, dir_fd=folder)


@contextlib.contextmanager
def _open_dir(name: str | Path, dir_fd: int | None, follow: bool = False) -> Iterator[int]:
    fd = os.open(name, _DIR_FLAGS | (0 if follow else _NOFOLLOW), dir_fd=dir_fd)
    try:
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def _open_file(folder: int, name: str) -> Iterator[tuple[BinaryIO, os.stat_result]]:
    """A regular file with one link, opened without following a link; anything else is not ours."""
    st = os.stat(name, dir_fd=folder, follow_symlinks=False)
    if not stat.S_ISREG(st.st_mode):  # checked before opening: opening a FIFO or device can block or act
        raise NotOurs("a link or not a regular file")
    fd = os.open(name, os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0), dir_fd=folder)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotOurs("a link or not a regular file")
        if st.st_nlink > 1:
            raise NotOurs(f"it has {st.st_nlink} hard links, so it is not the cache's alone")
        yield f, st


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view[:MAX_WRITE]) :]


def _why(e: OSError) -> str:
    if e.errno in (errno.ELOOP, errno.ENOTDIR):
        return f"{disk.reason(e)} (a link or not a folder: links below the cache root are never followed)"
    return disk.reason(e)
