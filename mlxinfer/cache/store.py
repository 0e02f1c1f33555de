"""Warmed prefixes on disk, so a restart does not lose a system prompt's KV.

One safetensors file per prefix: the token ids and each layer's keys and
values, with string metadata (format version, fingerprint, token count) and
nothing that names code to run. Files live in a folder per fingerprint (the
weights, tokenizer, chat template, compute dtype and cache format), so a
changed model never reads another model's KV. Writes go to a unique temporary
file renamed into place: two processes warming the same prefix each leave a
whole file. A file that fails any check is moved to `quarantine/` with a warning.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

log = logging.getLogger(__name__)

FORMAT = "mlxinfer-prefix-v1"
SAMPLE_BYTES = 1 << 20  # per sampled region of a weight file


@dataclass(frozen=True)
class StoredPrefix:
    path: Path
    token_ids: tuple[int, ...]
    nbytes: int


def fingerprint(weight_files: Iterable[Path], *parts: str) -> str:
    """A short hash of the model files (sizes and sampled contents) and of `parts` (tokenizer, template, dtype...).

    Sampling the start, middle and end of each file keeps this instant for
    multi-GB weights while any re-conversion or different download changes it.
    """
    digest = hashlib.sha256(FORMAT.encode())
    for file in sorted(weight_files):
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

    def __init__(self, root: Path, model_fingerprint: str, label: str = ""):
        self.root = Path(root)
        self.fingerprint = model_fingerprint
        self.folder = self.root / model_fingerprint
        self.label = label  # the model's name, for `mlxinfer cache ls`

    def save(self, token_ids: Sequence[int], layers: Sequence[tuple[mx.array, ...]]) -> Path:
        """Write one prefix atomically; returns its path."""
        self.folder.mkdir(parents=True, exist_ok=True)
        target = self.folder / f"{_ids_hash(token_ids)}.safetensors"
        arrays = {"token_ids": mx.array(list(token_ids), dtype=mx.int32)}
        for i, state in enumerate(layers):
            arrays.update({f"layers.{i}.{j}": a for j, a in enumerate(state)})
        metadata = {
            "format": FORMAT,
            "fingerprint": self.fingerprint,
            "tokens": str(len(token_ids)),
            "model": self.label,
        }
        temporary = self.folder / f".{target.stem}.{os.getpid()}.{uuid.uuid4().hex[:8]}.safetensors"
        try:
            mx.save_safetensors(str(temporary), arrays, metadata=metadata)
            os.replace(temporary, target)
        finally:
            temporary.unlink(missing_ok=True)
        return target

    def scan(self) -> list[StoredPrefix]:
        """Every stored prefix's token ids (the KV itself stays on disk until a hit)."""
        found = []
        for path in _prefix_files(self.folder.glob("*.safetensors")) if self.folder.is_dir() else []:
            try:
                ids, nbytes = _read_ids(path, self.fingerprint)
                found.append(StoredPrefix(path, ids, nbytes))
            except Exception as e:  # any damage: set it aside, never crash a load
                self.quarantine(path, e)
        return found

    def load(self, stored: StoredPrefix, layers: int) -> list[tuple[mx.array, ...]] | None:
        """The KV of a stored prefix, or None (file quarantined) if it does not check out."""
        try:
            ids, _ = _read_ids(stored.path, self.fingerprint)
            arrays = mx.load(str(stored.path))
            per_layer = (len(arrays) - 1) // layers if layers else 0
            if ids != stored.token_ids or per_layer < 2 or len(arrays) != per_layer * layers + 1:
                raise ValueError(f"holds {len(arrays) - 1} arrays, which do not split into {layers} layers")
            result = [tuple(arrays[f"layers.{i}.{j}"] for j in range(per_layer)) for i in range(layers)]
            if any(a.ndim != 4 or a.shape[2] != len(ids) for state in result for a in state):
                raise ValueError("a layer's length differs from its token count")
            return result
        except Exception as e:
            self.quarantine(stored.path, e)
            return None

    def quarantine(self, path: Path, reason: Exception) -> None:
        log.warning("ignoring prefix cache file %s (%s); moved to quarantine/", path, reason)
        target = self.root / "quarantine" / f"{path.parent.name}-{path.name}"
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            shutil.move(str(path), target)
        except OSError:
            path.unlink(missing_ok=True)


def list_prefixes(root: Path) -> list[dict[str, object]]:
    """What `mlxinfer cache ls` shows: each stored prefix's model, tokens and size, from headers only."""
    from safetensors import safe_open

    rows = []
    for path in _prefix_files(root.glob("*/*.safetensors")) if root.is_dir() else []:
        try:
            with safe_open(str(path), framework="numpy") as f:
                meta = f.metadata() or {}
        except Exception:
            meta = {"model": "(unreadable)"}
        rows.append(
            {
                "model": meta.get("model", "?"),
                "tokens": meta.get("tokens", "?"),
                "bytes": path.stat().st_size,
                "path": path,
            }
        )
    return rows


def clear_prefixes(root: Path) -> int:
    """Delete every stored prefix of every model (and the quarantine); returns how many files went."""
    files = _prefix_files(root.glob("*/*.safetensors")) if root.is_dir() else []
    shutil.rmtree(root, ignore_errors=True)
    return len(files)


def _prefix_files(paths: Iterable[Path]) -> list[Path]:
    # Names starting with "." are other processes' writes in progress.
    return sorted(p for p in paths if not p.name.startswith(".") and p.parent.name != "quarantine")


def _ids_hash(token_ids: Sequence[int]) -> str:
    return hashlib.sha256(np.asarray(token_ids, dtype=np.int64).tobytes()).hexdigest()[:32]


def _read_ids(path: Path, expected_fingerprint: str) -> tuple[tuple[int, ...], int]:
    """Token ids and KV bytes from the header and the small token_ids tensor, checked against the name."""
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        metadata = f.metadata() or {}
        if metadata.get("format") != FORMAT:
            raise ValueError(f"format {metadata.get('format')!r} is not {FORMAT}")
        if metadata.get("fingerprint") != expected_fingerprint:
            raise ValueError("made for other weights, tokenizer or settings")
        ids = tuple(int(t) for t in f.get_tensor("token_ids"))
        nbytes = sum(_nbytes(f.get_slice(k)) for k in f.keys() if k != "token_ids")
    if not ids or len(ids) != int(metadata.get("tokens", -1)) or path.stem != _ids_hash(ids):
        raise ValueError("token ids do not match the file's name or metadata")
    return ids, nbytes


def _nbytes(tensor_slice: object) -> int:
    shape, dtype = tensor_slice.get_shape(), tensor_slice.get_dtype()  # type: ignore[attr-defined]
    size = {"F32": 4, "F16": 2, "BF16": 2, "U32": 4, "I32": 4, "U8": 1}.get(dtype, 4)
    return int(np.prod(shape)) * size
