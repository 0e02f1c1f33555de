"""MLX's allocator limits, set from the plans of every loaded model.

The limits are process-wide, so each load (and each unload, when its model is
collected) sets them again from the plans of all models still loaded: the last
model loaded must not unwire the others' weights or shrink their buffer cache.
"""

from __future__ import annotations

import threading
import weakref

import mlx.core as mx

from .machine import MachineMemory
from .planner import MemoryPlan

MIN_CACHE_LIMIT = 256 << 20
WIRED_FRACTION = 0.7  # of Metal's recommended working set: an 8 GB Mac still needs room for the OS


_held: dict[int, MemoryPlan] = {}  # live models' plans, by a key of their own
_lock = threading.Lock()
_keys = iter(range(1 << 62))


def hold_limits(owner: object, plan: MemoryPlan) -> dict[str, int]:
    """Count `plan` in the limits for as long as `owner` (a loaded model) lives; returns the limits set."""
    with _lock:
        key = next(_keys)
        _held[key] = plan
        weakref.finalize(owner, _release, key)
        return _set_limits(*_combined(list(_held.values())))


def _release(key: int) -> None:
    with _lock:
        if _held.pop(key, None) is not None and _held:
            _set_limits(*_combined(list(_held.values())))


def _combined(plans: list[MemoryPlan]) -> tuple[MachineMemory, dict[str, int]]:
    """The newest plan's machine facts, and every plan's parts summed."""
    names = {name for plan in plans for name in plan.parts}
    return plans[-1].machine, {name: sum(plan.parts.get(name, 0) for plan in plans) for name in names}


def apply_limits(plan: MemoryPlan) -> dict[str, int]:
    """The limits for this one plan (see `hold_limits` for a loaded model)."""
    return _set_limits(plan.machine, plan.parts)


def _set_limits(machine: MachineMemory, parts: dict[str, int]) -> dict[str, int]:
    """Cap MLX's buffer cache near one prefill chunk's temporaries; on Metal, wire what the model needs.

    Wiring keeps the weights and KV cache resident (no paging stalls), but wired
    memory cannot be reclaimed by the OS, so only the planned need is wired and
    never more than WIRED_FRACTION of the working set.
    """
    cache_limit = max(MIN_CACHE_LIMIT, 2 * parts["prefill activations"])
    mx.set_cache_limit(cache_limit)
    limits = {"cache_limit": cache_limit}
    if machine.backend == "metal" and machine.working_set_bytes:
        resident = parts["weights"] + parts["kv cache"] + parts.get("recurrent state", 0)
        wired = min(resident, int(WIRED_FRACTION * machine.working_set_bytes))
        mx.set_wired_limit(wired)
        limits["wired_limit"] = wired
    return limits
