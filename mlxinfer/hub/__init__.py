"""Checkpoints from the Hugging Face Hub, through huggingface_hub: checked before the weights come, then downloaded
resumably into the one download cache that `pull` and `convert ORG/NAME` share. transport.py's rules (a stall
limit, size limits, no https downgrade) hold every request; the default model's index is read under them too."""

from .cached_copies import hf_cache_snapshot
from .pull import PullPlan, check_disk, download, download_dir, estimated_plan, finish, plan_download, plan_pull
from .repo import MAX_CONFIG_BYTES
from .transport import Unanswered, bounded, reason_of
from .transport import client as http_client

__all__ = [
    "MAX_CONFIG_BYTES",
    "PullPlan",
    "check_disk",
    "download",
    "download_dir",
    "estimated_plan",
    "finish",
    "hf_cache_snapshot",
    "Unanswered",
    "bounded",
    "http_client",
    "reason_of",
    "plan_download",
    "plan_pull",
]
