"""Why a write to disk failed, in a few words with what to do, and the process limit behind EFBIG.

Shared by the converter (an -o folder) and the prefix cache (MLXINFER_CACHE_DIR); each caller
names its own way to write elsewhere. The reasons are fixed words rather than strerror, whose
text differs between macOS and Linux. A leaf: imports nothing of mlxinfer.
"""

from __future__ import annotations

import errno
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_REASONS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file larger than this process may write (file-size limit, `ulimit -f`)",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENAMETOOLONG: "name too long",
}
# What to do; {elsewhere} is the caller's way to write somewhere else ("pick another -o").
_REMEDIES = {
    errno.ENOSPC: "free some space or {elsewhere}",
    errno.EDQUOT: "free some space or {elsewhere}",
    errno.EFBIG: "raise the limit or {elsewhere}",  # or the file system's own limit (FAT32: 4 GiB)
    errno.EACCES: "{elsewhere} (a folder you can write to)",
    errno.EPERM: "{elsewhere} (a folder you can write to)",
    errno.ENAMETOOLONG: "{elsewhere} (a shorter path)",
}


def reason(error: OSError) -> str:
    """A short reason for any failed file operation: fixed words for the common ones, else the OS's."""
    text = _REASONS.get(error.errno) or error.strerror or str(error) or type(error).__name__
    # One short printable line, whatever an odd OSError carries (a library's message, a path with escapes).
    printable = "".join(c if c.isprintable() else " " for c in str(text)[:1000])
    return " ".join(printable.split())[:200]


def remedy(error: OSError, elsewhere: str) -> str:
    """What to do about a failed write; for an unknown cause, writing elsewhere."""
    return _REMEDIES.get(error.errno, "{elsewhere}").format(elsewhere=elsewhere)


def write_error(error: OSError, elsewhere: str) -> str:
    """'<reason>; <what to do>' for a failed write, as one line."""
    return f"{reason(error)}; {remedy(error, elsewhere)}"


def file_size_limit() -> int | None:
    """This process's largest writable file (ulimit -f), or None without one or without `resource` (Windows)."""
    try:
        import resource
    except ImportError:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


@contextmanager
def file_size_errors() -> Iterator[None]:
    """Make a write past RLIMIT_FSIZE fail with OSError(EFBIG) instead of SIGXFSZ killing the process."""
    sig = getattr(signal, "SIGXFSZ", None)  # absent on Windows
    if sig is None or threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may change handlers; CPython ignores SIGXFSZ by default anyway
        return
    previous = signal.signal(sig, signal.SIG_IGN)
    try:
        yield
    finally:
        if previous is not None:  # None: set outside Python, cannot be put back
            signal.signal(sig, previous)
