"""Checkpoints from the Hugging Face Hub: checked over HTTP before the weights come, then downloaded resumably."""

from .pull import PullPlan, check_disk, download, download_dir, estimated_plan, finish, plan_pull

__all__ = ["PullPlan", "check_disk", "download", "download_dir", "estimated_plan", "finish", "plan_pull"]
