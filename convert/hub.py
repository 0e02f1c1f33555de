"""Download a checkpoint from the Hugging Face Hub, checking it before the big files.

config.json (and, online, the safetensors headers) are fetched first, so an
unsupported architecture or a pickle-only repository fails in seconds rather than
after gigabytes. Works offline (HF_HUB_OFFLINE=1) from the local Hub cache.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from mlxinfer.errors import ConversionError, UnsupportedModelError
from mlxinfer.models.config import normalize_config

log = logging.getLogger(__name__)

PATTERNS = ["*.json", "model*.safetensors", "tokenizer.model", "*.jinja"]


def fetch(repo_id: str) -> Path:
    """Local folder holding `repo_id`'s safetensors checkpoint."""
    from huggingface_hub import constants, hf_hub_download, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        config_path = hf_hub_download(repo_id, "config.json")
    except LocalEntryNotFoundError:
        raise ConversionError(
            f"{repo_id}: not in the local Hugging Face cache and the Hub cannot be reached; "
            "download it where there is network, or pass a local folder"
        ) from None
    except HfHubHTTPError as e:
        raise ConversionError(f"{repo_id}: cannot fetch config.json from the Hub ({e})") from None
    normalize_config(json.loads(Path(config_path).read_text()), source=f"{repo_id}/config.json")
    if not constants.HF_HUB_OFFLINE:
        _check_remote_headers(repo_id)
    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=PATTERNS))
    except (LocalEntryNotFoundError, HfHubHTTPError) as e:
        raise ConversionError(f"{repo_id}: download failed ({e})") from None
    log.info("%s: using %s", repo_id, folder)
    return folder


def _check_remote_headers(repo_id: str) -> None:
    from huggingface_hub import get_safetensors_metadata
    from huggingface_hub.errors import NotASafetensorsRepoError

    try:
        get_safetensors_metadata(repo_id)  # reads only each shard's header
    except NotASafetensorsRepoError:
        raise UnsupportedModelError(
            f"{repo_id}: has no safetensors weights (pickle checkpoints are never loaded)"
        ) from None
