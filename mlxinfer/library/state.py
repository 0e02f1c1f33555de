"""The library's two small JSON files: the models the user added (config folder) and when each was last used (cache).

Both are written atomically and read bounded; a missing file is empty, a corrupt one empty with a warning."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import platformdirs

from ..errors import LibraryError
from ..paths import cache_dir
from ..untrusted import read_json_object, shown_path
from .catalog import resolved

log = logging.getLogger(__name__)

REGISTRY_FILE = "models.json"  # in config_dir(): {"added": [absolute paths]}
USES_FILE = "last-used.json"  # in cache_dir(): {absolute path: unix time}
MAX_ADDED = 1000
MAX_USES = 1000
MAX_STATE_BYTES = 1 << 20  # either JSON file: a thousand paths take ~100 KB


def config_dir() -> Path:
    """Where mlxinfer keeps settings (the added models): $MLXINFER_CONFIG_DIR, else the platform's config folder."""
    override = os.environ.get("MLXINFER_CONFIG_DIR")
    return Path(override).expanduser() if override else Path(platformdirs.user_config_dir("mlxinfer"))


def registry() -> Path:
    """The file that lists the added models."""
    return config_dir() / REGISTRY_FILE


def read_added() -> list[str]:
    """The added models' absolute paths, each once, at most MAX_ADDED."""
    data = _read_state(registry())
    added = data.get("added", [])
    if not isinstance(added, list) or not all(isinstance(p, str) and os.path.isabs(p) for p in added):
        log.warning("%s: 'added' must be a list of absolute paths; ignoring it", shown_path(registry()))
        return []
    return list(dict.fromkeys(added))[:MAX_ADDED]


def write_added(paths: list[str]) -> None:
    """Replace the added models' list; raises LibraryError when it cannot be written."""
    _write_json(registry(), {"added": paths})


def read_uses() -> dict[str, float]:
    """{resolved path: unix time of its last record_use}."""
    data = _read_state(cache_dir() / USES_FILE)
    return {k: float(v) for k, v in data.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def record_use(path: Path) -> None:
    """Note that `path` was just loaded; never raises (a read-only cache only loses the time, with a warning)."""
    uses = read_uses()
    uses[str(resolved(Path(path)))] = time.time()
    newest = dict(sorted(uses.items(), key=lambda kv: kv[1], reverse=True)[:MAX_USES])
    try:
        _write_json(cache_dir() / USES_FILE, newest)
    except LibraryError as e:
        log.warning("%s", e)


def _read_state(path: Path) -> dict[str, Any]:
    """A small JSON object mlxinfer wrote; missing is empty, and corrupt is empty with a one-line warning."""
    if not path.exists():
        return {}
    try:
        return read_json_object(path, LibraryError, limit=MAX_STATE_BYTES)
    except LibraryError as e:
        log.warning("ignoring %s", e)
        return {}


def _write_json(path: Path, value: Any) -> None:
    """Write `value` to `path` atomically (a reader sees the old file or the new one, never half of one); raises
    LibraryError when it cannot."""
    partial = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as f:
            partial = f.name
            json.dump(value, f, indent=1)
        os.replace(partial, path)
    except OSError as e:
        if partial is not None:
            with contextlib.suppress(OSError):
                os.unlink(partial)
        raise LibraryError(f"{shown_path(path)}: cannot be written ({e.strerror or e})") from None
