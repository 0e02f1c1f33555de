"""The conditions a benchmark ran under, recorded next to every figure."""

from __future__ import annotations

import os
import platform
import subprocess
from datetime import datetime, timezone
from importlib import metadata
from typing import Any

import mlx.core as mx
import psutil

from .. import blas

VERSIONS = ("mlx", "mlx-lm", "mlxinfer", "transformers", "llama-cpp-python", "scipy-openblas32")


def conditions() -> dict[str, Any]:
    """Machine, software versions and backend, as plain JSON-able values."""
    memory = psutil.virtual_memory()
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "chip": _chip(),
        "machine": platform.machine(),
        "cores": os.cpu_count(),
        "memory_bytes": memory.total,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "backend": _backend(),
        "versions": {name: _version(name) for name in VERSIONS},
        "blas": blas.activate().as_dict(),  # what MLX's CPU GEMMs reach in this process, and its GFLOP/s
    }


def described(c: dict[str, Any]) -> str:
    """`conditions()` in one line, as result tables head them: the machine, the backend and the engines' versions."""
    versions = c["versions"]
    return (
        f"{c['chip']} ({c['cores']} cores, {c['memory_bytes'] / 2**30:.0f} GiB) · {c['os']} · backend {c['backend']} · "
        f"mlx {versions['mlx']} · mlx-lm {versions['mlx-lm']} · mlxinfer {versions['mlxinfer']}"
    )


def _backend() -> str:
    if mx.default_device().type != mx.DeviceType.gpu:
        return "cpu"
    return "metal" if mx.metal.is_available() else "cuda"


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _chip() -> str:
    if platform.system() == "Darwin":
        try:
            return subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, check=True
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
