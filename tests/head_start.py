"""python -m tests.head_start RUN_FOLDER PID: the README's default 4-bit conversion of the real SmolLM2, made into
RUN_FOLDER as tests/test_convert.py's `readme_conversion` makes it, from the moment the test run starts: started
when test_convert.py's turn came, its minutes of DWQ ran alone at the end of the run. If process PID (the run's
pytest) is gone, this process group ends, the conversion with it: an interrupted run leaves nothing running."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

from tests.model_cache import bf16_checkpoint
from tests.shared_conversions import README_DEFAULT, converted_once


def _watch(pid: int) -> None:
    while True:
        time.sleep(2)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            os.killpg(0, signal.SIGTERM)


def main() -> None:
    root, pid = Path(sys.argv[1]), int(sys.argv[2])
    threading.Thread(target=_watch, args=(pid,), daemon=True).start()
    smol_hf = bf16_checkpoint(root / f"head-start-cache-{os.getpid()}")  # (links: another worker's has its own)
    converted_once(root, smol_hf, *README_DEFAULT)


if __name__ == "__main__":
    main()
