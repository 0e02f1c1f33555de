"""Models on this machine that mlxinfer can load: MLX or Hugging Face folders and GGUF files in a folder."""

from __future__ import annotations

import os
from pathlib import Path


def models_dir() -> Path:
    """Where converted models live: $MLXINFER_MODELS_DIR, else ~/models (what the README's examples use)."""
    override = os.environ.get("MLXINFER_MODELS_DIR")
    return Path(override).expanduser() if override else Path.home() / "models"


def local_models(folder: Path | None = None) -> list[Path]:
    """Loadable models directly inside `folder` (default: models_dir()), sorted by name; none if it is missing."""
    folder = folder or models_dir()
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if _is_model(p)]
    return sorted(found, key=lambda p: p.name.lower())


def _is_model(path: Path) -> bool:
    if path.is_file():
        return path.suffix == ".gguf"
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))
