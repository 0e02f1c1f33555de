"""Warmed prefixes on disk, so a restart does not lose a system prompt's KV.

One safetensors file per prefix: the token ids and each layer's keys and
values, with string metadata (format version, fingerprint, token count, the
sha256 of the tensors) and nothing that names code to run. Files live in a
folder per fingerprint (the weights, tokenizer, chat template, compute dtype
and cache format), so a changed model never reads another model's KV. Writes go
to a unique temporary file renamed into place: two processes warming the same
prefix each leave a whole file.

Files on disk are untrusted input. Before a file's KV is used, its header must
match the model's KV layout exactly (names, dtypes, shapes, a token count within
the context, offsets that tile the file) and its tensors must hash to the
checksum written with them. A file of ours that fails is moved to `quarantine/`
with a warning; the prompt is then prefilled as if nothing was cached.

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
import io
import json
import logging
import math
import os
import re
import shutil
import stat
import struct
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import mlx.core as mx
import numpy as np

from ..display import mib
from ..errors import CacheError

log = logging.getLogger(__name__)

FORMAT = "mlxinfer-prefix-v2"  # v2: a checksum of the tensors and a header that tiles the file
_FORMAT_FAMILY = "mlxinfer-prefix-"  # any version of ours; an older one is quarantined, not left alone
SAMPLE_BYTES = 1 << 20  # per sampled region of a weight file
QUARANTINE = "quarantine"
MAX_HEADER_BYTES = 1 << 22  # ours take ~100 bytes a tensor: room for 6 arrays x 5000 layers
MAX_FILES = 1024  # prefixes read at start-up; beyond this a folder is not what warm makes
MAX_WRITE = 1 << 30  # per os.write call: macOS refuses more than 2 GiB at once
_PREFIX_NAME = re.compile(r"[0-9a-f]{32}\.safetensors")
_TEMP_NAME = re.compile(r"\.[0-9a-f]{32}\.\d+\.[0-9a-f]{8}\.safetensors")
_FOLDER_NAME = re.compile(r"[0-9a-f]{24}")
_FOLDER_FILES = re.compile(f"{_PREFIX_NAME.pattern}|{_TEMP_NAME.pattern}")  # what clear removes there
_QUARANTINED_NAME = re.compile(r"[0-9a-f]{24}-[0-9a-f]{32}(\.[0-9a-f]{8})?\.safetensors")
_DTYPE_NAMES = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16", mx.uint32: "U32", mx.int32: "I32"}
# The safetensors dtypes of our files, as numpy reads them (little-endian; bfloat16's bits as uint16).
_NUMPY_DTYPES = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "U32": "<u4", "I32": "<i4"}
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)


class _NotOurs(CacheError):
    """A path in the cache that mlxinfer did not write: never read as a prefix, moved or deleted."""


@dataclass(frozen=True)
class StoredPrefix:
    path: Path
    token_ids: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class KVLayout:
    """What every prefix file of one model must hold, derived from the model, never from the file."""

    layers: int
    arrays: tuple[tuple[str, tuple[int, ...]], ...]  # per layer: (safetensors dtype, shape with 0 positions)
    max_tokens: int  # the model's context: no prefix is longer

    @classmethod
    def of(cls, layers: int, kv_heads: int, head_dim: int, dtype: mx.Dtype, max_tokens: int,
           kv_bits: int | None = None, group_size: int = 64) -> KVLayout:  # fmt: skip
        """The layout of cache/kv.py's caches: keys and values, or their (packed, scales, biases) triplets."""
        name = _DTYPE_NAMES[dtype]
        if kv_bits is None:
            return cls(layers, ((name, (1, kv_heads, 0, head_dim)),) * 2, max_tokens)
        packed = ("U32", (1, kv_heads, 0, head_dim * kv_bits // 32))
        group = (name, (1, kv_heads, 0, head_dim // group_size))
        return cls(layers, (packed, group, group) * 2, max_tokens)

    def tensors(self, tokens: int) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Name -> (dtype, shape) of every tensor in the file of a `tokens`-long prefix."""
        found = {"token_ids": ("I32", (tokens,))}
        for i in range(self.layers):
            for j, (dtype, shape) in enumerate(self.arrays):
                found[f"layers.{i}.{j}"] = (dtype, (*shape[:2], tokens, *shape[3:]))
        return found

    def data_bytes(self, tokens: int) -> int:
        return sum(_nbytes(dtype, shape) for dtype, shape in self.tensors(tokens).values())

    def file_bytes(self, tokens: int) -> int:
        """The size of the file, rounded up (a header takes well under 128 bytes a tensor, plus its metadata)."""
        return self.data_bytes(tokens) + 4096 + 128 * (1 + self.layers * len(self.arrays))


_Found = tuple[Path, str, os.stat_result, dict]  # a file of ours: folder, name, stat, metadata


@dataclass(frozen=True)
class _Header:
    metadata: dict
    entries: dict  # tensor name -> its raw header entry, checked against the layout before use
    data_start: int
    size: int


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

    def check_room(self, tokens: int) -> None:
        """Raise CacheError now if a `tokens`-long prefix cannot be written, before minutes of prefill."""
        needed = self.layout.file_bytes(tokens)
        try:
            with self._folder(create=True) as (_, folder):
                free = shutil.disk_usage(self.folder).free
                limit = _file_size_limit()
                if free < needed:
                    raise CacheError(
                        f"{self.folder}: {mib(free)} free but a {tokens}-token prefix takes {mib(needed)}; "
                        "free some space or point MLXINFER_CACHE_DIR at a disk with room"
                    )
                if limit is not None and needed > limit:
                    raise CacheError(
                        f"{self.folder}: a {tokens}-token prefix takes {mib(needed)}, over this process's "
                        f"file-size limit of {mib(limit)} (ulimit -f); raise it or warm a shorter prefix"
                    )
                self._write_atomically(folder, None, [])
        except OSError as e:
            raise self._unwritable(e) from None

    def save(self, token_ids: Sequence[int], layers: Sequence[tuple[mx.array, ...]]) -> Path:
        """Write one prefix atomically with the checksum of its tensors; returns its path."""
        tensors = {"token_ids": mx.array(list(token_ids), dtype=mx.int32)}
        for i, state in enumerate(layers):
            tensors.update({f"layers.{i}.{j}": mx.contiguous(a) for j, a in enumerate(state)})
        mx.eval(tensors)
        self._check_arrays(tensors, len(token_ids))
        data = {name: memoryview(tensors[name]).cast("B") for name in sorted(tensors)}
        metadata = {
            "format": FORMAT,
            "fingerprint": self.fingerprint,
            "tokens": str(len(token_ids)),
            "model": self.label,
            "sha256": _checksum(data.items()),
        }
        name = f"{_ids_hash(token_ids)}.safetensors"
        try:
            with self._folder(create=True) as (_, folder):
                self._write_atomically(folder, name, [_encode_header(metadata, tensors), *data.values()])
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

    def load(self, stored: StoredPrefix) -> list[tuple[mx.array, ...]] | None:
        """The KV of a stored prefix, or None (and the file quarantined if ours) if it does not check out."""
        identity = None
        try:
            with self._folder() as (_, folder), _open_file(folder, stored.path.name) as (f, st):
                identity = (st.st_dev, st.st_ino)
                buffer = _read_whole(stored.path, f, st, 8 + MAX_HEADER_BYTES + self._data_bytes(stored))
            arrays = self._verified_arrays(buffer, stored)
        except _NotOurs as e:
            log.warning("leaving %s alone and not using it: %s", stored.path, e)
            return None
        except CacheError as e:
            self._quarantine(stored.path.name, e, identity)
            return None
        except OSError as e:
            log.warning("not using prefix cache file %s (%s)", stored.path, _why(e))
            return None
        per_layer = len(self.layout.arrays)
        return [tuple(arrays[f"layers.{i}.{j}"] for j in range(per_layer)) for i in range(self.layout.layers)]

    def _scan_one(self, folder: int, name: str) -> StoredPrefix | None:
        path, identity = self.folder / name, None
        try:
            with _open_file(folder, name) as (f, st):
                identity = (st.st_dev, st.st_ino)
                header = _read_header(f, st.st_size)
                tokens = _check_header(path, header, self.fingerprint, self.layout)
                ids = _read_ids(path, f, header, tokens)
        except _NotOurs as e:
            log.warning("leaving %s alone: %s", path, e)
            return None
        except CacheError as e:
            self._quarantine(name, e, identity)
            return None
        except OSError as e:
            log.warning("not using prefix cache file %s (%s)", path, _why(e))
            return None
        return StoredPrefix(path, ids, self.layout.data_bytes(tokens) - 4 * tokens)

    def _data_bytes(self, stored: StoredPrefix) -> int:
        return self.layout.data_bytes(len(stored.token_ids))

    def _verified_arrays(self, buffer: bytes, stored: StoredPrefix) -> dict[str, mx.array]:
        """The tensors of a file, once every check passed on the bytes read once."""
        header = _read_header(io.BytesIO(buffer), len(buffer))
        tokens = _check_header(stored.path, header, self.fingerprint, self.layout)
        ids = _read_ids(stored.path, io.BytesIO(buffer), header, tokens)
        if ids != stored.token_ids:
            raise CacheError(f"{stored.path}: its token ids changed since start-up")
        data = {name: _tensor_bytes(buffer, header, name) for name in sorted(header.entries)}
        if _checksum(data.items()) != header.metadata.get("sha256"):
            raise CacheError(f"{stored.path}: the checksum of its tensors does not match its sha256 metadata")
        # Arrays made from the checked bytes by the checked dtypes and shapes: no second parser reads the file.
        return {name: _array(view, *self.layout.tensors(tokens)[name]) for name, view in data.items()}

    def _check_arrays(self, tensors: dict[str, mx.array], tokens: int) -> None:
        # A layout that differs from the model's real KV would write files that every load rejects.
        found = {name: (_DTYPE_NAMES.get(a.dtype, str(a.dtype)), tuple(a.shape)) for name, a in tensors.items()}
        expected = self.layout.tensors(tokens)
        if found != expected:
            wrong = sorted(set(found.items()) ^ set(expected.items()))[:2]
            raise CacheError(f"{self.label}: its KV does not have the layout the prefix cache expects ({wrong})")

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
        return CacheError(
            f"cannot write warmed prefixes to {self.folder}: {_why(e)}; free some space, raise the file-size "
            "limit, or point MLXINFER_CACHE_DIR at a writable folder"
        )

    def _quarantine(self, name: str, reason: Exception, identity: tuple[int, int] | None) -> None:
        """Move our file `name` to quarantine/ within the root; if that cannot be done safely, leave it."""
        try:
            with self._folder() as (root, folder):
                with contextlib.suppress(FileExistsError):
                    os.mkdir(QUARANTINE, 0o755, dir_fd=root)
                with _open_dir(QUARANTINE, root) as quarantine:
                    st = os.stat(name, dir_fd=folder, follow_symlinks=False)
                    if identity is None or (st.st_dev, st.st_ino) != identity:
                        raise _NotOurs("it changed since it was read")
                    os.replace(name, self._quarantine_name(quarantine, name), src_dir_fd=folder, dst_dir_fd=quarantine)
        except (OSError, _NotOurs) as e:
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
        tokens = _count(metadata.get("tokens"))
        rows.append(
            {
                "model": _printable(metadata.get("model", "?")),
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
        raise CacheError(f"cannot read the prefix cache {root}: {_why(e)}; check MLXINFER_CACHE_DIR") from None


def _our_files_in(root: Path, root_fd: int, folder_name: str, pattern: re.Pattern, unlink: bool) -> Iterator[_Found]:
    folder_path = root / folder_name
    try:
        with _open_dir(folder_name, root_fd) as folder:
            for name in sorted(e.name for e in os.scandir(folder)):
                try:
                    if not pattern.fullmatch(name):
                        raise _NotOurs("not a name the cache writes")
                    with _open_file(folder, name) as (f, st):
                        metadata = _read_header(f, st.st_size).metadata
                    if unlink:
                        _unlink_same(folder, name, st)
                    yield folder_path, name, st, metadata
                except _NotOurs as e:
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
        raise _NotOurs("it changed while being checked")
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
        raise _NotOurs("a link or not a regular file")
    fd = os.open(name, os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0), dir_fd=folder)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _NotOurs("a link or not a regular file")
        if st.st_nlink > 1:
            raise _NotOurs(f"it has {st.st_nlink} hard links, so it is not the cache's alone")
        yield f, st


def _read_whole(path: Path, f: BinaryIO, st: os.stat_result, limit: int) -> bytes:
    # Bounded by what a prefix of this length takes, before reading: a file may grow or lie about its size.
    buffer = f.read(min(st.st_size, limit) + 1)
    if len(buffer) > limit:
        raise CacheError(f"{path}: larger than the {limit} bytes a prefix of its token count takes")
    return buffer


def _read_header(f: BinaryIO, size: int) -> _Header:
    """The header of a prefix file of ours; _NotOurs for anything whose header does not say so."""
    prefix = f.read(8)
    if len(prefix) < 8:
        raise _NotOurs(f"{size} bytes is too short for a safetensors file")
    (length,) = struct.unpack("<Q", prefix)
    if length > min(MAX_HEADER_BYTES, size - 8):
        raise _NotOurs(f"it declares a {length}-byte header in a {size}-byte file")
    try:
        header = json.loads(f.read(length), object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise _NotOurs("its header is not JSON with unique keys") from None
    metadata = header.pop("__metadata__", None) if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or not str(metadata.get("format", "")).startswith(_FORMAT_FAMILY):
        raise _NotOurs("its header does not say it is an mlxinfer prefix")
    return _Header(metadata, header, 8 + length, size)


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    # With a name twice, which entry counts would depend on the parser: refused instead.
    found = dict(pairs)
    if len(found) != len(pairs):
        raise ValueError("a key appears twice")
    return found


def _check_header(path: Path, header: _Header, expected_fingerprint: str, layout: KVLayout) -> int:
    """The token count, once the header matches this model's layout exactly; CacheError names what differs."""
    metadata = header.metadata
    if metadata.get("format") != FORMAT:
        raise CacheError(f"{path}: format {metadata.get('format')!r} is not {FORMAT}; warm the prefix again")
    if metadata.get("fingerprint") != expected_fingerprint:
        raise CacheError(f"{path}: made for other weights, tokenizer or settings")
    tokens = _count(metadata.get("tokens"))
    if tokens is None or not 0 < tokens <= layout.max_tokens:
        shown = str(metadata.get("tokens"))[:20]
        raise CacheError(f"{path}: metadata tokens={shown!r} is not a count in [1, {layout.max_tokens}] (the context)")
    _check_tensors(path, header, layout.tensors(tokens))
    return tokens


def _count(value: object) -> int | None:
    """A token count written as a short decimal string, else None (never int() of a huge or odd string)."""
    ok = isinstance(value, str) and 0 < len(value) <= 12 and value.isascii() and value.isdigit()
    return int(value) if ok else None


def _check_tensors(path: Path, header: _Header, expected: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """Exactly the expected tensors, written in name order with no gap, ending at the end of the file."""
    if set(header.entries) != set(expected):
        odd = sorted(set(header.entries) ^ set(expected))
        shown = _printable(", ".join(odd[:3]))
        raise CacheError(f"{path}: tensors {shown} do not match the model's {len(expected)} (a wrong layer count?)")
    offset = 0
    for name in sorted(expected):
        entry, (dtype, shape) = header.entries[name], expected[name]
        if not isinstance(entry, dict) or entry.get("dtype") != dtype or not _same_ints(entry.get("shape"), shape):
            raise CacheError(f"{path}: tensor {name} is not {dtype} of shape {list(shape)}, as the model needs")
        end = offset + _nbytes(dtype, shape)
        if not _same_ints(entry.get("data_offsets"), (offset, end)):
            shown = _printable(entry.get("data_offsets"))
            raise CacheError(f"{path}: tensor {name} has data_offsets {shown}, not {[offset, end]}")
        offset = end
    if header.data_start + offset != header.size:
        raise CacheError(f"{path}: {header.size} bytes, but its header describes {header.data_start + offset}")


def _same_ints(value: object, expected: tuple[int, ...]) -> bool:
    # type() is int: JSON's true or 2.0 compare equal to 1 or 2 but are not what we wrote.
    return isinstance(value, list) and all(type(v) is int for v in value) and tuple(value) == expected


def _read_ids(path: Path, f: BinaryIO, header: _Header, tokens: int) -> tuple[int, ...]:
    f.seek(header.data_start + header.entries["token_ids"]["data_offsets"][0])
    raw = f.read(4 * tokens)
    if len(raw) != 4 * tokens:
        raise CacheError(f"{path}: truncated in its token ids")
    ids = tuple(int(t) for t in np.frombuffer(raw, dtype="<i4"))
    if path.name != f"{_ids_hash(ids)}.safetensors":
        raise CacheError(f"{path}: its token ids do not match the file's name")
    return ids


def _tensor_bytes(buffer: bytes, header: _Header, name: str) -> memoryview:
    begin, end = header.entries[name]["data_offsets"]
    return memoryview(buffer)[header.data_start + begin : header.data_start + end]


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * np.dtype(_NUMPY_DTYPES[dtype]).itemsize


def _array(data: memoryview, dtype: str, shape: tuple[int, ...]) -> mx.array:
    array = mx.array(np.frombuffer(data, dtype=_NUMPY_DTYPES[dtype]).reshape(shape))
    return array.view(mx.bfloat16) if dtype == "BF16" else array


def _checksum(tensors: Iterable[tuple[str, bytes | memoryview]]) -> str:
    """sha256 over each tensor's name and bytes, in name order (the order the file holds them)."""
    digest = hashlib.sha256()
    for name, data in tensors:
        digest.update(name.encode() + b"\0")
        digest.update(data)
    return digest.hexdigest()


def _encode_header(metadata: dict[str, str], tensors: dict[str, mx.array]) -> bytes:
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name in sorted(tensors):
        a, end = tensors[name], offset + tensors[name].nbytes
        header[name] = {"dtype": _DTYPE_NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # tensors start 8-byte aligned, as the format recommends
    return struct.pack("<Q", len(raw)) + raw


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view[:MAX_WRITE]) :]


def _file_size_limit() -> int | None:
    """This process's largest writable file (ulimit -f), or None without one or without `resource` (Windows)."""
    try:
        import resource
    except ImportError:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


def _why(e: OSError) -> str:
    if e.errno in (errno.ELOOP, errno.ENOTDIR):
        return f"{e.strerror} (a link or not a folder: links below the cache root are never followed)"
    return e.strerror or str(e)


def _printable(text: object) -> str:
    # Metadata is from disk: no terminal escapes or newlines reach `cache ls` output.
    return "".join(c if c.isprintable() else "?" for c in str(text))[:80]


def _ids_hash(token_ids: Sequence[int]) -> str:
    return hashlib.sha256(np.asarray(token_ids, dtype=np.int64).tobytes()).hexdigest()[:32]
