"""A Hub id's checkpoint for the converter, from the one download cache `mlxinfer pull` uses.

Online, mlxinfer.hub checks the repository (file list, config.json, each shard's header) before any weights come,
so an unsupported family or a pickle-only repository fails in seconds; the files then download (checked against
the Hub's sizes and hashes, resumable) into $MLXINFER_CACHE_DIR/downloads, where a later pull of the same commit
finds them. A complete copy of that commit already in the Hugging Face cache is used as it is. Offline
(HF_HUB_OFFLINE=1) the Hugging Face cache is the only source: it is read, never written.
"""

from __future__ import annotations

import logging
from pathlib import Path

from mlxinfer.errors import ConversionError
from mlxinfer.hub import MAX_CONFIG_BYTES, check_disk, download, hf_cache_snapshot, plan_download
from mlxinfer.library import hf_cache_dir
from mlxinfer.models import normalize_config
from mlxinfer.untrusted import read_json_object

log = logging.getLogger(__name__)

PATTERNS = ["*.json", "model*.safetensors", "tokenizer.model", "*.jinja"]


def fetch(repo_id: str, progress: bool = True) -> Path:
    """Local folder holding `repo_id`'s safetensors checkpoint (the head of its main branch)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return _from_hf_cache(repo_id)
    plan = plan_download(repo_id)
    folder = hf_cache_snapshot(plan.listing, plan.files)  # put there by another tool: used as it is
    if folder is None:
        check_disk(plan)
        folder = download(plan, progress=progress)
    log.info("%s: using %s", repo_id, folder)
    return folder


def _from_hf_cache(repo_id: str) -> Path:
    """The Hugging Face cache's snapshot of `repo_id`'s main branch, its config checked; no network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = Path(
            snapshot_download(repo_id, allow_patterns=PATTERNS, cache_dir=hf_cache_dir(), local_files_only=True)
        )
    except (LocalEntryNotFoundError, ValueError):  # ValueError: an id huggingface_hub refuses
        folder = None
    if folder is None or not (folder / "config.json").is_file():
        raise ConversionError(
            f"{repo_id}: not in the local Hugging Face cache and the Hub cannot be reached; "
            "download it where there is network, or pass a local folder"
        )
    config = read_json_object(folder / "config.json", ConversionError, limit=MAX_CONFIG_BYTES)
    normalize_config(config, source=f"{repo_id}/config.json")
    log.info("%s: using %s (offline)", repo_id, folder)
    return folder
