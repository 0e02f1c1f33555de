"""The notebooks run top to bottom in a real Jupyter kernel; a failing cell fails the build."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
# The kernels compute from float32 weights, as `auto` chooses on a CPU where that measures faster (conftest pins
# "quantized" so that auto's timing cannot flip outputs between tests): MLX's CPU quantized matmul has no BLAS
# behind it, and made the convert notebook's quality reports alone take ~80 s. A GPU keeps the stored weights.
CPU_WEIGHTS = "dense"


def run_notebook(name: str, tmp_path: Path) -> nbformat.NotebookNode:
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    NotebookClient(
        notebook, timeout=1200, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    return notebook


def outputs(notebook: nbformat.NotebookNode) -> str:
    parts = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            parts.append(output.get("text", ""))
            parts.extend(str(v) for v in output.get("data", {}).values())
    return "\n".join(parts)


def test_quickstart_notebook(smol_path, default_cache, monkeypatch, tmp_path):
    monkeypatch.setenv("MLXINFER_CACHE_DIR", str(default_cache))  # the kernel finds the fetched default model
    monkeypatch.setenv("MLXINFER_CPU_WEIGHTS", CPU_WEIGHTS)
    text = outputs(run_notebook("quickstart.ipynb", tmp_path))
    assert "The capital of France is Paris." in text
    for caption in ("Model SmolLM2", "Generation", "Memory plan"):
        assert caption in text  # the rich HTML reprs rendered


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_convert_notebook(smol_hf, default_cache, monkeypatch, tmp_path):
    monkeypatch.setenv("MLXINFER_CACHE_DIR", str(default_cache))
    monkeypatch.setenv("MLXINFER_HF_CHECKPOINT", str(smol_hf))
    monkeypatch.setenv("MLXINFER_CPU_WEIGHTS", CPU_WEIGHTS)
    # A shorter run than a user's: 128 tokens still rank 8 bits at least as close to the source as 4 (the
    # notebook asserts it; 64 did not), 16 decoded tokens still give a speed.
    monkeypatch.setenv("MLXINFER_NOTEBOOK_EVAL_TOKENS", "128")
    monkeypatch.setenv("MLXINFER_NOTEBOOK_DECODE_TOKENS", "16")
    notebook = run_notebook("convert.ipynb", tmp_path)
    text = outputs(notebook)
    assert "Quantization quality" in text and "4-bit:" in text and "8-bit:" in text
    assert any("image/png" in o.get("data", {}) for c in notebook.cells for o in c.get("outputs", []))
    removed = Path(text.split("Removed ")[1].split()[0])  # the conversions' temporary folder, gone at the end
    assert removed.name.startswith("mlxinfer-convert-") and not removed.exists()
