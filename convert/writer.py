"""Write a model folder atomically, in shards, with a manifest of checksums.

Everything goes into `.OUT.partial-<pid>` beside OUT and is renamed into place at
the end, so an interrupted or failed conversion never leaves a half-written OUT.
A later run removes partial folders whose process is gone.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxinfer.errors import ConversionError

log = logging.getLogger(__name__)

DEFAULT_SHARD_BYTES = 1 << 30


class AtomicFolder:
    """A temporary folder that becomes `out` on commit() and vanishes otherwise."""

    def __init__(self, out: Path, force: bool):
        self.out = out
        if out.exists() and not force:
            raise ConversionError(f"{out}: already exists; pass --force to replace it")
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_partials(out)
        self.path = out.parent / f".{out.name}.partial-{os.getpid()}"
        shutil.rmtree(self.path, ignore_errors=True)
        self.path.mkdir()

    def commit(self) -> None:
        old = None
        if self.out.exists():
            old = self.out.parent / f".{self.out.name}.old-{os.getpid()}"
            os.replace(self.out, old)
        os.replace(self.path, self.out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def abort(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def remove_stale_partials(out: Path) -> None:
    for stale in out.parent.glob(f".{out.name}.partial-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            log.warning("removing %s left by an interrupted conversion", stale)
            shutil.rmtree(stale, ignore_errors=True)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # a previous run of ours that reused our pid
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ShardWriter:
    """Collects tensors and writes a shard whenever `max_bytes` are pending."""

    def __init__(self, folder: Path, max_bytes: int = DEFAULT_SHARD_BYTES):
        self.folder, self.max_bytes = folder, max_bytes
        self._pending: dict[str, mx.array] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, array: mx.array) -> None:
        self._pending[name] = array
        self._pending_bytes += array.nbytes
        if self._pending_bytes >= self.max_bytes:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        index = len(self._shards)
        mx.save_safetensors(str(self.folder / f"shard-{index}.partial.safetensors"), self._pending, {"format": "mlx"})
        self._shards.append(sorted(self._pending))
        self.total_bytes += self._pending_bytes
        self._pending, self._pending_bytes = {}, 0

    def finish(self) -> list[str]:
        """Name the shards model-0000i-of-0000N and write the index; returns the file names."""
        self.flush()
        count, names, weight_map = len(self._shards), [], {}
        for i, tensors in enumerate(self._shards):
            name = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            os.replace(self.folder / f"shard-{i}.partial.safetensors", self.folder / name)
            names.append(name)
            weight_map.update(dict.fromkeys(tensors, name))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        write_json(self.folder / "model.safetensors.index.json", index)
        return names


def write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


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
