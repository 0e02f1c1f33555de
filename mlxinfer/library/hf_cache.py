"""The models in the Hugging Face hub cache: where the cache is, its loadable snapshots, and deleting a repository.

The cache is read through huggingface_hub's own scanner, and only when it holds at most MAX_HF_REPOS entries."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import LibraryError
from ..untrusted import first_line, shown_path
from .catalog import is_loadable, resolved

log = logging.getLogger(__name__)

MAX_HF_REPOS = 1000  # folders in the hub cache looked at; a larger cache is skipped with a warning


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, read from the environment now (huggingface_hub reads it once, at import)."""
    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(key):
            return Path(os.environ[key]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def cached_models() -> Iterator[tuple[str, Path]]:
    """(repo id, snapshot) of each cached model repository whose newest loadable snapshot holds config.json and
    *.safetensors, by repo id."""
    info = _scan_hf_cache()
    for repo in sorted(info.repos if info else (), key=lambda r: r.repo_id):
        path = _snapshot(repo)
        if path is not None:
            yield repo.repo_id, path


def cached_model(repo_id: str) -> Path | None:
    """What cached_models() gives for `repo_id`, from that one repository's cache folder (never a whole scan)."""
    org, _, name = repo_id.partition("/")
    if not org or not name or "/" in name or "--" in repo_id or repo_id.startswith(".") or not repo_id.isprintable():
        return None  # not a name huggingface_hub's cache folders give
    root = hf_cache_dir()
    folder = root / f"models--{org}--{name}"
    try:
        if not folder.is_dir() or not _in_bounds(root):
            return None
        from huggingface_hub.utils._cache_manager import _scan_cached_repo

        repo = _scan_cached_repo(folder)
    except ImportError:  # another huggingface_hub: the whole (bounded) scan
        return next((path for found, path in cached_models() if found == repo_id), None)
    except Exception as e:  # noqa: BLE001 - a broken cache entry is no model, as in scan_cache_dir
        log.warning("skipping %s in the Hugging Face cache: %s", shown_path(folder), first_line(e))
        return None
    return _snapshot(repo) if repo.repo_id == repo_id else None


def lists_snapshot(key: Path) -> bool:
    """Whether cached_models() gives resolved path `key` (say, a model the user also added) as a snapshot."""
    root = resolved(hf_cache_dir())
    try:
        parts = key.relative_to(root).parts
    except ValueError:
        return False
    repo = parts[0].split("--", 1) if parts else []
    if len(parts) != 3 or parts[1] != "snapshots" or len(repo) != 2 or repo[0] != "models":
        return False
    path = cached_model(repo[1].replace("--", "/"))
    return path is not None and resolved(path) == key


def remove_repo(repo_id: str) -> list[Path]:
    """Delete every revision of model repository `repo_id` through huggingface_hub; returns its folder."""
    info = _scan_hf_cache()
    repo = next((r for r in info.repos if r.repo_id == repo_id and r.repo_type == "model"), None) if info else None
    if repo is None:
        raise LibraryError(f"{repo_id}: no longer in the Hugging Face cache {shown_path(hf_cache_dir())}")
    try:
        info.delete_revisions(*(r.commit_hash for r in repo.revisions)).execute()
    except OSError as e:
        raise LibraryError(f"{repo.repo_path}: cannot be deleted ({e.strerror or e})") from None
    return [Path(repo.repo_path)]


def _snapshot(repo: Any) -> Path | None:
    """A cached model repository's newest snapshot that holds config.json and *.safetensors, or None."""
    if repo.repo_type != "model":
        return None
    snapshots = sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True)
    return next((r.snapshot_path for r in snapshots if is_loadable(r.snapshot_path)), None)


def _in_bounds(root: Path) -> bool:
    """At most MAX_HF_REPOS entries in the hub cache folder (a larger one is skipped, with a warning)."""
    with os.scandir(root) as listing:
        count = sum(1 for _ in zip(listing, range(MAX_HF_REPOS + 1)))
    if count > MAX_HF_REPOS:
        log.warning("skipping the Hugging Face cache %s: more than %d entries", shown_path(root), MAX_HF_REPOS)
    return count <= MAX_HF_REPOS


def _scan_hf_cache() -> Any:
    root = hf_cache_dir()
    try:
        if not root.is_dir() or not _in_bounds(root):
            return None
        from huggingface_hub import scan_cache_dir

        return scan_cache_dir(root)
    except Exception as e:  # noqa: BLE001 - a broken cache must not hide the other models
        log.warning("skipping the Hugging Face cache %s: %s", shown_path(root), first_line(e))
        return None
