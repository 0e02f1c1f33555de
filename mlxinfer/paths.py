"""Where mlxinfer keeps what it downloads and builds: one home for the cache folder every room uses."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs


def cache_dir() -> Path:
    """Where mlxinfer keeps downloaded models, downloads in progress and prompt caches; MLXINFER_CACHE_DIR
    overrides it."""
    override = os.environ.get("MLXINFER_CACHE_DIR")
    return Path(override) if override else Path(platformdirs.user_cache_dir("mlxinfer"))
