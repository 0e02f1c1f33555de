"""Conversions of the real SmolLM2 that several tests read, each made once per test run in a folder that
pytest-xdist's workers share (the first makes it under a lock, the others wait for it). The README's default 4-bit
conversion is also started by tests/head_start.py when the run starts (conftest's `head_start`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.model_cache import locked

# The README's conversion line (`--bits 4`: the learned default) with the quality report on 128 tokens: the one
# end-to-end run of the default recipe, and the suite's longest piece of work (minutes of DWQ).
README_DEFAULT = ("SmolLM2-4bit", "--bits", "4", "--eval-tokens", "128")


def run_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test run's folder: above each xdist worker's own, else the session's."""
    root = tmp_path_factory.getbasetemp()
    return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root


def once_per_run(root: Path, name: str, make: Callable[[Path], None]) -> Path:
    """The folder root/`name`, filled by make(folder) unless a process of this run did already."""
    folder = root / name
    with locked(root / f"{name}.lock"):
        if not (folder / ".made").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            (folder / ".made").touch()
    return folder


def convert_in_a_process(smol_hf: Path, out: Path, *flags: str) -> subprocess.CompletedProcess:
    """`mlxinfer convert smol_hf -o out FLAGS` in a process of its own, so that its peak memory is the conversion's
    alone. With the quantized kernels, as conftest pins them: the forecast counts the output's weights as
    written, not dequantized to float32."""
    command = [sys.executable, "-m", "mlxinfer.cli", "convert", str(smol_hf), "-o", str(out), *flags]
    env = {**os.environ, "MLXINFER_CPU_WEIGHTS": "quantized"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-1500:]
    return done


def converted_once(root: Path, smol_hf: Path, name: str, *flags: str) -> Path:
    """The folder holding `convert_in_a_process`'s output (root/name/name), stdout and stderr, made once per run."""

    def make(folder: Path) -> None:
        done = convert_in_a_process(smol_hf, folder / name, *flags)
        (folder / "stdout").write_text(done.stdout)
        (folder / "stderr").write_text(done.stderr)

    return once_per_run(root, name, make)
