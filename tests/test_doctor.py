"""`mlxinfer doctor`: what it reports about this machine, and the fixes and exit code for slow or broken setups."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from click.testing import CliRunner

from mlxinfer import doctor
from mlxinfer.cli import main
from mlxinfer.default_model import FILE_NAME

CHECKS = ["device", "packages", "blas", "memory", "disk", "caches", "default_model", "cpu_weights"]


@pytest.fixture
def folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """mlxinfer's cache, the models folder and the Hugging Face cache in temp folders (none of the user's)."""
    paths = {"cache": tmp_path / "cache", "models_dir": tmp_path / "models", "hf_cache": tmp_path / "hub"}
    monkeypatch.setenv("MLXINFER_CACHE_DIR", str(paths["cache"]))
    monkeypatch.setenv("MLXINFER_MODELS_DIR", str(paths["models_dir"]))
    monkeypatch.setenv("HF_HUB_CACHE", str(paths["hf_cache"]))
    monkeypatch.delenv("MLXINFER_BLAS", raising=False)
    return paths


def fill(folders: dict[str, Path]) -> dict[str, int]:
    """Known bytes: the default model's file and a nested file in the cache (a link not counted), one model file."""
    (folders["cache"] / "models").mkdir(parents=True)
    (folders["cache"] / "models" / FILE_NAME).write_bytes(b"GGUF" + b"\0" * 996)
    (folders["cache"] / "prefixes" / "deep").mkdir(parents=True)
    (folders["cache"] / "prefixes" / "deep" / "p.safetensors").write_bytes(b"x" * 2345)
    (folders["cache"] / "link").symlink_to(folders["cache"] / "models" / FILE_NAME)
    folders["models_dir"].mkdir()
    (folders["models_dir"] / "m.gguf").write_bytes(b"y" * 7)
    return {"cache": 1000 + 2345, "models_dir": 7}


def run_json() -> tuple[int, dict]:
    result = CliRunner().invoke(main, ["doctor", "--json"])
    return result.exit_code, json.loads(result.stdout)


def run_json_process(**env: str) -> tuple[int, dict]:
    """`python -m mlxinfer.cli doctor --json` in a fresh process (BLAS is chosen once, at import)."""
    command = [sys.executable, "-m", "mlxinfer.cli", "doctor", "--json"]
    result = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
    return result.returncode, json.loads(result.stdout)


def test_json_reports_this_machine(folders):
    sizes = fill(folders)
    code, out = run_json_process()
    checks = out["checks"]
    assert code == 0 and list(checks) == CHECKS
    assert all(set(c) == {"status", "summary", "value", "fix"} for c in checks.values())
    assert checks["device"]["value"]["backend"] == "cpu" and checks["device"]["value"]["compute_dtype"] == "float32"
    assert checks["packages"]["value"]["mlx"] == version("mlx")
    assert checks["packages"]["value"]["mlx-lm"] == version("mlx-lm")
    assert checks["blas"]["value"]["gflops"] > 0
    if sys.platform.startswith("linux"):
        assert checks["blas"]["value"]["name"].startswith("OpenBLAS") and checks["blas"]["status"] == "ok"
    assert checks["disk"]["value"]["free_bytes"] > 0
    assert checks["memory"]["value"]["usable_bytes"] > 0
    caches = checks["caches"]["value"]
    assert caches["cache"] == {"path": str(folders["cache"]), "exists": True, "bytes": sizes["cache"], "complete": True}
    assert caches["models_dir"]["bytes"] == sizes["models_dir"]
    assert caches["hf_cache"] == {"path": str(folders["hf_cache"]), "exists": False, "bytes": 0, "complete": True}
    assert checks["default_model"]["value"]["cached"] is True
    assert checks["cpu_weights"]["value"]["mode"] == os.environ.get("MLXINFER_CPU_WEIGHTS", "auto")


def test_reference_blas_is_a_warning_with_the_way_to_openblas(folders):
    code, out = run_json_process(MLXINFER_BLAS="reference")
    assert code == 0
    blas = out["checks"]["blas"]
    assert blas["status"] == "warn" and out["status"] == "warn"
    assert "unset MLXINFER_BLAS" in blas["fix"] and "pip install scipy-openblas32 pyelftools" in blas["fix"]
    assert out["checks"]["default_model"]["value"]["cached"] is False
    assert not folders["cache"].exists(), "doctor must not download or create anything"
    assert out["checks"]["disk"]["value"]["free_bytes"] > 0  # measured on the nearest folder that exists


def test_mlx_cpu_next_to_mlx_cuda_is_broken(folders, monkeypatch):
    real = doctor.installed_version
    fake = {"mlx-cpu": "0.32.4", "mlx-cuda-12": "0.32.4"}
    monkeypatch.setattr(doctor, "installed_version", lambda p: fake[p] if p in fake else real(p))
    code, out = run_json()
    packages = out["checks"]["packages"]
    assert code == 1 and out["status"] == "broken" and packages["status"] == "broken"
    want = f"pip uninstall -y mlx-cpu && pip install --force-reinstall --no-deps mlx-cuda-12=={version('mlx')}"
    assert want in packages["fix"]


def test_human_output_is_a_line_per_check_with_the_fixes(folders, monkeypatch):
    monkeypatch.setenv("MLXINFER_CPU_WEIGHTS", "fastest")
    result = CliRunner().invoke(main, ["doctor"])
    lines = result.stdout.splitlines()
    check_lines = [line for line in lines if not line.startswith(" ")]
    assert [line.split()[1] for line in check_lines] == CHECKS
    assert result.exit_code == 1
    broken = next(i for i, line in enumerate(lines) if line.startswith("BROKEN ") and "cpu_weights" in line)
    assert lines[broken + 1].strip() == "fix: set MLXINFER_CPU_WEIGHTS to auto, dense or quantized (or unset it: auto)"
    assert all(line.strip().startswith("fix: ") for line in lines if line.startswith(" "))


def test_folder_walk_is_bounded_and_follows_no_links(tmp_path):
    for i in range(5):
        (tmp_path / f"f{i}").write_bytes(b"z" * 10)
    (tmp_path / "loop").symlink_to(tmp_path)
    assert doctor.folder_bytes(tmp_path) == (50, True)
    size, complete = doctor.folder_bytes(tmp_path, max_entries=3)
    assert not complete and size <= 30
