"""Fine-tuning adapters (LoRA, DoRA) over a loaded base model: read from mlx-lm's or PEFT's folders, installed
per row so that requests for different adapters share one batch and one copy of the base."""

from .adapter_set import MAX_ADAPTERS, AdapterSet, install
from .fused import fuse_into, fused
from .reading import Adapter, LowRank, read_adapter
from .rows import BASE, NO_ADAPTER, Chosen, selected

__all__ = ["BASE", "MAX_ADAPTERS", "NO_ADAPTER", "Adapter", "AdapterSet", "Chosen", "LowRank"]
__all__ += ["fuse_into", "fused", "install", "read_adapter", "selected"]
