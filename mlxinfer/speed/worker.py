"""Run one benchmark configuration in this process: a RunSpec as JSON on stdin, progress lines and then the
Measurement as one JSON line on stdout (each marked: engines print too)."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

from .measure import RunSpec, measure

RESULT_PREFIX = "MLXINFER-BENCH-RESULT "
PROGRESS_PREFIX = "MLXINFER-BENCH-PROGRESS "


def main() -> None:
    spec = RunSpec(**json.load(sys.stdin))
    result = measure(spec, lambda line: print(PROGRESS_PREFIX + line, flush=True))
    # Engines may print (mlx-lm does); the prefix marks our line.
    print(RESULT_PREFIX + json.dumps(asdict(result)), flush=True)


if __name__ == "__main__":
    main()
