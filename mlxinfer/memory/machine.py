"""What this machine has: memory, swap, and on Apple GPUs the Metal working set."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import psutil

# Never plan on the last slice of memory: the OS, the browser and the user's
# other apps live there, and macOS compresses and swaps long before it is gone.
HEADROOM_FRACTION = 0.15
MIN_HEADROOM_BYTES = 1 << 30


@dataclass(frozen=True)
class MachineMemory:
    total_bytes: int
    available_bytes: int  # free now, reclaimable caches included (psutil)
    swap_used_bytes: int
    backend: str  # "metal", "cuda" or "cpu"
    working_set_bytes: int | None  # Metal's recommended maximum working set; on CUDA, the GPU's free memory
    max_buffer_bytes: int | None  # the largest single buffer the GPU allows

    @property
    def headroom_bytes(self) -> int:
        return max(MIN_HEADROOM_BYTES, int(HEADROOM_FRACTION * self.total_bytes))

    def usable_bytes(self, already_ours: int = 0) -> int:
        """Memory mlxinfer may plan on: what is available plus what it already holds, less headroom."""
        usable = self.available_bytes + already_ours - self.headroom_bytes
        if self.working_set_bytes:
            usable = min(usable, self.working_set_bytes)
        return max(0, usable)


def machine_memory() -> MachineMemory:
    """Measure now (available memory changes as the user opens and closes apps)."""
    vm, swap = psutil.virtual_memory(), psutil.swap_memory()
    backend, working_set, max_buffer = "cpu", None, None
    if mx.metal.is_available():
        info = mx.device_info()
        backend = "metal"
        working_set = int(info.get("max_recommended_working_set_size", 0)) or None
        max_buffer = int(info.get("max_buffer_length", 0)) or None
    elif mx.cuda.is_available():
        # A discrete GPU: weights and caches live in its own memory, so what it has free now bounds the plan
        # (MLX's CUDA device_info reads it through NVML, so other processes' use counts).
        info = mx.device_info()
        backend = "cuda"
        working_set = int(info.get("free_memory") or info.get("total_memory") or info.get("memory_size") or 0) or None
    return MachineMemory(vm.total, vm.available, swap.used, backend, working_set, max_buffer)
