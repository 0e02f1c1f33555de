"""Tests that drive system programs (Chromium, Xvfb, trayer): skipped on a laptop without them, never in CI.

CI (CI=true) runs `scripts/system-packages.sh` first, so a missing program there is a failure, not a skip.
"""

from __future__ import annotations

import os
import shutil

import pytest


def require(*programs: str) -> None:
    missing = [p for p in programs if shutil.which(p) is None]
    if not missing:
        return
    message = f"needs {', '.join(missing)} (scripts/system-packages.sh installs them on Debian/Ubuntu)"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)
