"""This process's memory high-water mark."""

from __future__ import annotations

import platform
import resource


def peak_rss_bytes() -> int:
    """Peak resident set size of this process, in bytes."""
    # Linux carries ru_maxrss across fork+exec (a child would report its parent's
    # peak); VmHWM belongs to this process's own address space.
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if platform.system() == "Darwin" else peak * 1024  # macOS reports bytes, Linux KiB
