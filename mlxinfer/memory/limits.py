"""MLX's allocator limits, set from the plan."""

from __future__ import annotations

import mlx.core as mx

from .planner import MemoryPlan

MIN_CACHE_LIMIT = 256 << 20
WIRED_FRACTION = 0.7  # of Metal's recommended working set: an 8 GB Mac still needs room for the OS


def apply_limits(plan: MemoryPlan) -> dict[str, int]:
    """Cap MLX's buffer cache near one prefill chunk's temporaries; on Metal, wire what the model needs.

    Wiring keeps the weights and KV cache resident (no paging stalls), but wired
    memory cannot be reclaimed by the OS, so only the planned need is wired and
    never more than WIRED_FRACTION of the working set.
    """
    parts = plan.parts
    cache_limit = max(MIN_CACHE_LIMIT, 2 * parts["prefill activations"])
    mx.set_cache_limit(cache_limit)
    limits = {"cache_limit": cache_limit}
    if plan.machine.backend == "metal" and plan.machine.working_set_bytes:
        wired = min(parts["weights"] + parts["kv cache"], int(WIRED_FRACTION * plan.machine.working_set_bytes))
        mx.set_wired_limit(wired)
        limits["wired_limit"] = wired
    return limits
