"""`mlxinfer doctor`: what this machine gives mlxinfer (device, packages, BLAS, memory, disk, caches) and how to fix
what is slow or broken.

Every check only looks: nothing is downloaded, installed, or set (the Metal wired limit included). Each check is
a `Check` whose status is "ok", "warn" (slow but working: a fix is given) or "broken" (a fix is given and the
command exits 1). The command line only renders `diagnose()`'s result.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import mlx.core as mx

from .blas import SLOW_GFLOPS, BlasReport, activate, probe_gflops
from .default_model import DISPLAY_NAME, default_model_path
from .display import mib
from .errors import DefaultModelError, MlxInferError
from .library import hf_cache_dir, models_dir
from .memory.machine import machine_memory
from .models.cpu_weights import cpu_weights_mode
from .models.dtype import choose_compute_dtype, dtype_name
from .paths import cache_dir

OK, WARN, BROKEN = "ok", "warn", "broken"
PACKAGES = ("mlx", "mlx-lm", "mlx-metal", "mlx-cpu", "mlx-cuda-12", "mlx-cuda-13")
CUDA_PACKAGES = ("mlx-cuda-12", "mlx-cuda-13")
MAX_WALK_ENTRIES = 200_000  # files and folders one cache-size walk looks at before it says "at least"
LOW_MEMORY_BYTES = 1 << 30  # below this usable, only the smallest models fit
LOW_DISK_BYTES = 2 << 30  # below this free, a pull of a small model can fail
OPENBLAS_FIX = "unset MLXINFER_BLAS to use OpenBLAS, and if it is missing `pip install scipy-openblas32 pyelftools`"


@dataclass(frozen=True)
class Check:
    """One finding: a short line for people, the facts for --json, and a fix unless all is well."""

    name: str
    status: str  # OK, WARN or BROKEN
    summary: str
    value: Any  # JSON-serialisable facts
    fix: str | None = None


def diagnose() -> list[Check]:
    """Run every check, in the order `mlxinfer doctor` prints them."""
    steps = (device, packages, blas, memory, disk, caches, default_model, cpu_weights)
    return [step() for step in steps]


def worst(checks: list[Check]) -> str:
    statuses = {c.status for c in checks}
    return BROKEN if BROKEN in statuses else WARN if WARN in statuses else OK


def as_dict(checks: list[Check]) -> dict[str, Any]:
    """--json's object: {"status": worst, "checks": {name: {status, summary, value, fix}}}."""
    return {"status": worst(checks), "checks": {c.name: _without_name(c) for c in checks}}


def _without_name(check: Check) -> dict[str, Any]:
    fields = asdict(check)
    del fields["name"]
    return fields


# ---- device and packages -------------------------------------------------------------------------------------


def backend() -> str:
    """The backend MLX computes on: "metal" or "cuda" where it sees that GPU, else "cpu"."""
    if getattr(getattr(mx, "metal", None), "is_available", lambda: False)():
        return "metal"
    if getattr(getattr(mx, "cuda", None), "is_available", lambda: False)():
        return "cuda"
    return "cpu"


def device() -> Check:
    name = backend()
    info = _device_info()
    value = {
        "backend": name,
        "device": str(mx.default_device()),
        "name": info.get("device_name") or platform.processor() or platform.machine(),
        "cpu_cores": os.cpu_count(),
        "compute_dtype": dtype_name(choose_compute_dtype()),
    }
    summary = f"{name}: {value['device']} on {value['name']}, computes in {value['compute_dtype']}"
    if name == "cpu" and sys.platform == "darwin" and platform.machine() == "arm64":
        fix = "MLX sees no Metal GPU: `pip install -U mlx` in an arm64 (not Rosetta) Python"
        return Check("device", WARN, summary, value, fix)
    if name == "cpu" and any(installed_version(p) for p in CUDA_PACKAGES):
        fix = "mlx-cuda is installed but sees no GPU: check `nvidia-smi` and that the driver matches its CUDA"
        return Check("device", WARN, summary, value, fix)
    return Check("device", OK, summary, value)


def _device_info() -> dict[str, Any]:
    try:
        return dict(mx.device_info())
    except (AttributeError, RuntimeError, ValueError):
        return {}


def installed_version(package: str) -> str | None:
    """The installed distribution's version, or None (the one place doctor asks; tests replace it)."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def packages() -> Check:
    versions = {p: installed_version(p) for p in PACKAGES}
    summary = ", ".join(f"{p} {v}" for p, v in versions.items() if v)
    cuda = [p for p in CUDA_PACKAGES if versions[p]]
    if versions["mlx-cpu"] and cuda:
        fix = (
            f"`pip uninstall -y mlx-cpu && pip install --force-reinstall --no-deps {cuda[0]}=={versions['mlx']}`"
            " (both write mlx/lib/libmlx.so, so one overwrote the other)"
        )
        return Check("packages", BROKEN, f"{summary}: mlx-cpu and {cuda[0]} are both installed", versions, fix)
    if not versions["mlx-lm"]:
        fix = '`pip install "mlx-lm>=0.32,<0.33"` (a dependency of mlxinfer)'
        return Check("packages", BROKEN, f"{summary}: mlx-lm is not installed", versions, fix)
    return Check("packages", OK, summary, versions)


# ---- speed -----------------------------------------------------------------------------------------------------


def blas() -> Check:
    report = activate()
    value = report.as_dict()
    if report.gflops is None:  # not measured by activate() (macOS, or routing failed before the probe)
        try:
            value["gflops"] = probe_gflops()
        except ValueError as e:
            fix = "reinstall MLX: `pip install --force-reinstall mlx` (its matmul gives wrong results here)"
            return Check("blas", BROKEN, f"{report.name}: {e}", value, fix)
    threads = f" on {report.threads} thread{'s' * (report.threads != 1)}" if report.threads else ""
    summary = f"{report.name}, float32 matmul at {value['gflops']:.1f} GFLOP/s{threads}"
    fix = _blas_fix(report, value["gflops"])
    return Check("blas", WARN if fix else OK, summary, value, fix)


def _blas_fix(report: BlasReport, gflops: float) -> str | None:
    if sys.platform.startswith("linux") and not report.name.startswith("OpenBLAS"):
        if os.environ.get("MLXINFER_BLAS", "").lower() == "reference":
            return f"MLXINFER_BLAS=reference keeps the slow reference BLAS: {OPENBLAS_FIX}"
        if report.note and "no faster" in report.note:  # OpenBLAS loaded but lost the probe: a busy CPU
            return f"{report.note.split(';')[0]}: close what keeps the CPU busy, or try fewer OPENBLAS_NUM_THREADS"
        why = f"{report.note.split(';')[0]}; " if report.note else ""
        return f"{why}{OPENBLAS_FIX}"
    if gflops < SLOW_GFLOPS:
        return f"float32 matmul is slow ({gflops:.1f} GFLOP/s): close what keeps the CPU busy, or use the GPU"
    return None


# ---- memory and disk -------------------------------------------------------------------------------------------


def memory() -> Check:
    seen = machine_memory()
    value = {
        "total_bytes": seen.total_bytes,
        "available_bytes": seen.available_bytes,
        "usable_bytes": seen.usable_bytes(),
        "swap_used_bytes": seen.swap_used_bytes,
        "working_set_bytes": seen.working_set_bytes,
        "max_buffer_bytes": seen.max_buffer_bytes,
        "wired_limit": _wired_limit(seen.backend, seen.working_set_bytes),
    }
    summary = f"the planner sees {_gib(value['usable_bytes'])} usable of {_gib(seen.total_bytes)}"
    if seen.working_set_bytes and seen.backend == "metal":
        summary += f"; Metal working set {_gib(seen.working_set_bytes)}, wired limit {value['wired_limit']['note']}"
    elif seen.working_set_bytes:  # CUDA: the card's own memory bounds the plan
        summary += f"; the GPU has {_gib(seen.working_set_bytes)} free"
    if value["usable_bytes"] < LOW_MEMORY_BYTES:
        fix = "little memory is free: close other apps, or use a smaller or 4-bit model (`--kv-bits 4` helps too)"
        return Check("memory", WARN, summary, value, fix)
    return Check("memory", OK, summary, value)


def _wired_limit(backend_name: str, working_set: int | None) -> dict[str, Any]:
    """What is known of Metal's wired-memory limit, read only: MLX can set it but not read it back."""
    if backend_name != "metal":
        return {"max_bytes": None, "system_mb": None, "note": "not applicable (no Metal GPU)"}
    system_mb = _sysctl_int("iogpu.wired_limit_mb")
    where = f"{system_mb} MB (iogpu.wired_limit_mb)" if system_mb else "the system default (iogpu.wired_limit_mb 0)"
    return {"max_bytes": working_set, "system_mb": system_mb, "note": f"{where}, at most {_gib(working_set or 0)}"}


def _sysctl_int(key: str) -> int | None:
    try:
        out = subprocess.run(["sysctl", "-n", key], capture_output=True, text=True, timeout=5, check=False).stdout
        return int(out.strip())
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def disk() -> Check:
    folder = cache_dir()
    existing = nearest_existing(folder)
    free = shutil.disk_usage(existing).free
    value = {"path": str(folder), "measured_at": str(existing), "free_bytes": free}
    summary = f"{_gib(free)} free for {folder}"
    if not os.access(existing, os.W_OK):
        fix = f"{existing} is not writable: set MLXINFER_CACHE_DIR to a writable folder"
        return Check("disk", BROKEN, summary, value, fix)
    if free < LOW_DISK_BYTES:
        fix = "free some space, or set MLXINFER_CACHE_DIR (and MLXINFER_MODELS_DIR) to a disk with room"
        return Check("disk", WARN, summary, value, fix)
    return Check("disk", OK, summary, value)


def nearest_existing(path: Path) -> Path:
    """`path`, or the closest folder above it that exists (a cache not made yet still has a disk)."""
    path = path.expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


# ---- caches and the default model -----------------------------------------------------------------------------


def caches() -> Check:
    folders = {"cache": cache_dir(), "models_dir": models_dir(), "hf_cache": hf_cache_dir()}
    value = {name: _folder_size(path) for name, path in folders.items()}
    summary = "; ".join(f"{name} {f['path']} {_size_text(f)}" for name, f in value.items())
    return Check("caches", OK, summary, value)


def _folder_size(path: Path) -> dict[str, Any]:
    exists = path.is_dir()
    size, complete = folder_bytes(path) if exists else (0, True)
    return {"path": str(path), "exists": exists, "bytes": size, "complete": complete}


def _size_text(folder: dict[str, Any]) -> str:
    if not folder["exists"]:
        return "(none yet)"
    return f"({'at least ' if not folder['complete'] else ''}{mib(folder['bytes'])})"


def folder_bytes(root: Path, max_entries: int = MAX_WALK_ENTRIES) -> tuple[int, bool]:
    """Sum of file sizes under `root`, links not followed; (bytes, False) when it stopped at `max_entries`."""
    total, seen, folders = 0, 0, [root]
    while folders:
        try:
            with os.scandir(folders.pop()) as listing:
                for entry in listing:
                    seen += 1
                    if seen > max_entries:
                        return total, False
                    if entry.is_dir(follow_symlinks=False):
                        folders.append(Path(entry.path))
                    elif entry.is_file(follow_symlinks=False):
                        total += entry.stat(follow_symlinks=False).st_size
        except OSError:  # unreadable or vanished: count what can be read
            continue
    return total, True


def default_model() -> Check:
    try:
        path, cached = default_model_path(download=False), True
    except DefaultModelError:
        path, cached = cache_dir() / "models", False
    value = {"name": DISPLAY_NAME, "path": str(path), "cached": cached}
    summary = f"{DISPLAY_NAME} cached at {path}" if cached else f"{DISPLAY_NAME} not cached yet"
    if not cached:
        summary += " (`mlxinfer chat` fetches it once, 93 MB)"
    return Check("default_model", OK, summary, value)


def cpu_weights() -> Check:
    try:
        mode = cpu_weights_mode()
    except MlxInferError as e:
        fix = "set MLXINFER_CPU_WEIGHTS to auto, dense or quantized (or unset it: auto)"
        return Check("cpu_weights", BROKEN, str(e), {"mode": None}, fix)
    return Check("cpu_weights", OK, f"{mode} (MLXINFER_CPU_WEIGHTS)", {"mode": mode})


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"
