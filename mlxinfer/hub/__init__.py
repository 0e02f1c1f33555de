"""Checkpoints from the Hugging Face Hub: checked over HTTP before the weights come, then downloaded resumably
into the one download cache that `pull` and `convert ORG/NAME` share."""

from .cached_copies import hf_cache_snapshot
from .pull import PullPlan, check_disk, download, download_dir, estimated_plan, finish, plan_download, plan_pull
from .repo import MAX_CONFIG_BYTES
from .transport import open_url

__all__ = [
    "MAX_CONFIG_BYTES",
    "PullPlan",
    "check_disk",
    "download",
    "download_dir",
    "estimated_plan",
    "finish",
    "hf_cache_snapshot",
    "open_url",
    "plan_download",
    "plan_pull",
]
