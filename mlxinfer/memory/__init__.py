"""Memory: what this machine has, what a model needs, and one budget for all of it."""

from .limits import apply_limits, hold_limits
from .machine import MachineMemory, machine_memory
from .planner import (
    MemoryPlan,
    ModelFootprint,
    batch_peak_bytes,
    default_prefix_cache_bytes,
    fit_prefill_chunk,
    plan_memory,
)
from .process import peak_rss_bytes

__all__ = [
    "apply_limits",
    "hold_limits",
    "batch_peak_bytes",
    "MachineMemory",
    "MemoryPlan",
    "ModelFootprint",
    "default_prefix_cache_bytes",
    "fit_prefill_chunk",
    "machine_memory",
    "peak_rss_bytes",
    "plan_memory",
]
