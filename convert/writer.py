"""Write the files of a model folder: weights in shards, JSON, copied tokenizer files, checksums.

Each file is new ("x" mode), so nothing is written through a link planted in the folder;
a failed write is one ConversionError naming the file. Where the folder is and how it
replaces OUT: output_folder.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

import mlx.core as mx

from mlxinfer.disk import write_error
from mlxinfer.display import mib
from mlxinfer.errors import ConversionError
from mlxinfer.tokenizer.tokenizer import MAX_TOKENIZER_BYTES
from mlxinfer.untrusted import MAX_SIDE_FILE_BYTES, shown_path

DEFAULT_SHARD_BYTES = 1 << 30
HEADER_BYTES = 64 << 10  # per shard, when the caller names no bound (header_bound)
SAFETENSORS_DTYPES = {
    mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16", mx.uint32: "U32", mx.int32: "I32",
    mx.uint8: "U8", mx.int8: "I8", mx.uint16: "U16", mx.int16: "I16", mx.int64: "I64", mx.uint64: "U64",
    mx.bool_: "BOOL",
}  # fmt: skip
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "tokenizer.model",
)
# The most the loader reads of each (tokenizer.json, or any other side file): a larger one is refused here,
# not written into an output that could never load.
COPY_LIMITS = {"tokenizer.json": MAX_TOKENIZER_BYTES}


def copy_limit(name: str) -> int:
    return COPY_LIMITS.get(name, MAX_SIDE_FILE_BYTES)


def os_error(error: OSError, path: str | Path) -> ConversionError:
    """A one-line ConversionError for a failed write at `path`, with what to do about it."""
    return ConversionError(f"{shown_path(path)}: {write_error(error, 'pick another -o')}")


@contextmanager
def writing(path: str | Path) -> Iterator[None]:
    """Any OSError inside becomes os_error(path)."""
    try:
        yield
    except OSError as e:
        raise os_error(e, path) from e


class ShardWriter:
    """Writes each tensor's bytes to its shard file as it arrives; a shard closes at `max_bytes`.

    A safetensors header lists every tensor's offsets before the data, so each shard starts with
    `header_bytes` reserved for it (the format allows a header padded with spaces), filled in when the
    shard closes; a shard whose header would outgrow the space closes early. Memory holds one tensor,
    never a shard (a 1 GiB pending shard was most of a small MoE conversion's peak), and the disk holds
    nothing twice."""

    def __init__(self, folder: Path, max_bytes: int = DEFAULT_SHARD_BYTES, header_bytes: int = HEADER_BYTES):
        self.folder, self.max_bytes = folder, max_bytes
        self.header_bytes = _aligned(max(header_bytes, len(_header({}))))
        self._entries: dict[str, dict[str, Any]] = {}
        self._file: BinaryIO | None = None
        self._reserved = 0  # this shard's header space
        self._header_size = 0  # at most what its header takes so far (entries counted at their widest)
        self._written = 0
        self._shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, array: mx.array) -> None:
        mx.eval(array)
        data = memoryview(array).tobytes()  # C order, whatever the array's strides
        entry = {"dtype": SAFETENSORS_DTYPES[array.dtype], "shape": list(array.shape), "data_offsets": [0, 0]}
        needed = _entry_bytes(name, entry)
        if self._file is not None and self._header_size + needed > self._reserved:
            self.flush()
        if self._file is None:
            self._header_size = len(_header({}))
            self._reserved = max(self.header_bytes, _aligned(self._header_size + needed))
            with writing(self._path):
                self._file = open(self._path, "xb")  # a new file only: nothing is written through a planted link
                self._file.seek(8 + self._reserved)
        with writing(self._path):
            self._file.write(data)
        entry["data_offsets"] = [self._written, self._written + len(data)]
        self._entries[name] = entry
        self._header_size += needed
        self._written += len(data)
        if self._written >= self.max_bytes:
            self.flush()

    @property
    def _path(self) -> Path:
        return self.folder / f"shard-{len(self._shards)}.partial.safetensors"

    def flush(self) -> None:
        if self._file is None:
            return
        header = _header(self._entries)
        with writing(self._path):
            self._file.seek(0)
            self._file.write(struct.pack("<Q", self._reserved) + header + b" " * (self._reserved - len(header)))
            self._file.close()
        self._file = None
        self._shards.append(sorted(self._entries))
        self.total_bytes += self._written
        self._entries, self._written = {}, 0

    def abandon(self) -> None:
        """Close a shard that a failed write left open, dropping what its buffer still holds.

        Left to the garbage collector, the buffer would be written whenever the file is collected: past a
        file-size limit, once SIGXFSZ is deadly again, that kills the process after its error was shown."""
        file, self._file = self._file, None
        if file is not None:
            file.raw.close()  # the buffered file's own close() would try to write the buffer once more

    def finish(self) -> list[str]:
        """Name the shards model-0000i-of-0000N and write the index; returns the file names."""
        self.flush()
        count, names, weight_map = len(self._shards), [], {}
        for i, tensors in enumerate(self._shards):
            name = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            with writing(self.folder / name):
                os.replace(self.folder / f"shard-{i}.partial.safetensors", self.folder / name)
            names.append(name)
            weight_map.update(dict.fromkeys(tensors, name))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        write_json(self.folder / "model.safetensors.index.json", index)
        return names


def header_bound(tensors: dict[str, int]) -> int:
    """Header bytes that hold `tensors` ({name: number of dimensions}) whatever their sizes."""
    entries = ((name, {"dtype": "BF16", "shape": [0] * ndim}) for name, ndim in tensors.items())
    return _aligned(len(_header({})) + sum(_entry_bytes(name, entry) for name, entry in entries))


def _header(entries: dict[str, dict[str, Any]]) -> bytes:
    return json.dumps({"__metadata__": {"format": "mlx"}, **entries}, separators=(",", ":")).encode()


def _entry_bytes(name: str, entry: dict[str, Any]) -> int:
    """The most bytes one tensor's entry adds to a header: its numbers at their widest, its comma included."""
    return len(json.dumps({name: _widest(entry)}, separators=(",", ":")).encode()) - 1  # - {} + ","


def _widest(entry: dict[str, Any]) -> dict[str, Any]:
    """`entry` with every number as wide as it can get (offsets up to 2**64, dimensions up to 2**31)."""
    return {**entry, "shape": [2**31] * len(entry["shape"]), "data_offsets": [2**64, 2**64]}


def _aligned(n: int) -> int:
    return n + (-(n + 8) % 8)  # the data starts 8-byte aligned (after the 8-byte length)


def write_json(path: Path, value: Any) -> None:
    write_text(path, json.dumps(value, indent=2, ensure_ascii=False) + "\n")


def write_text(path: Path, text: str) -> None:
    # "x": a new file only, so nothing is ever written through a link planted in the folder.
    with writing(path), open(path, "x", encoding="utf-8") as f:
        f.write(text)


def check_tokenizer_files(folder: Path) -> None:
    """Before any work: refuse a tokenizer file in `folder` larger than the loader reads."""
    for name in TOKENIZER_FILES:
        try:
            size = os.stat(folder / name).st_size
        except OSError:
            continue  # absent (or unreadable: copy_file names it)
        if size > copy_limit(name):
            raise _too_large(folder / name, copy_limit(name))


def _too_large(src: Path, limit: int) -> ConversionError:
    return ConversionError(
        f"{shown_path(src)}: larger than {mib(limit, 0)}, the most mlxinfer loads; not a tokenizer file to copy"
    )


def copy_file(src: Path, dst: Path, limit: int | None = None) -> None:
    """Copy at most `limit` bytes (default: what the loader reads of that file) of a source file.

    A link is followed; the source is only read."""
    limit = copy_limit(dst.name) if limit is None else limit
    try:
        source = open(src, "rb")
    except OSError as e:
        raise ConversionError(f"{shown_path(src)}: cannot read it ({e.strerror})") from e
    too_large = _too_large(src, limit)
    with source:
        if os.fstat(source.fileno()).st_size > limit:
            raise too_large
        with writing(dst), open(dst, "xb") as target:
            copied = 0
            for block in iter(lambda: source.read(1 << 20), b""):
                copied += len(block)
                if copied > limit:  # it grew while we copied
                    raise too_large
                target.write(block)


def sha256_files(folder: Path) -> dict[str, str]:
    """sha256 of every file in `folder`, by name."""
    digests = {}
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        digests[path.name] = digest.hexdigest()
    return digests
