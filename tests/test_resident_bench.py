"""The resident-server bench (bench/resident_bench.py) end to end on the tiny fixture: `--quick`, about 20 s."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil

from bench.resident_bench import ratio, spread

ROOT = Path(__file__).resolve().parents[1]


def test_spread_and_ratio():
    assert spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert ratio(3.0, 1.5) == "2.00x" and ratio(1.0, 0) == "-"


def test_quick_run_measures_both_setups_and_all_four_ways(tmp_path):
    (tmp_path / "tmp").mkdir()  # the bench's private dirs land here: its processes are known by their environment
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path / "tmp")}
    done = subprocess.run(
        [sys.executable, "-m", "bench.resident_bench", "--quick", "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    table = next(tmp_path.glob("*-quick-resident.md")).read_text()
    assert "| before: each loads it | 3 |" in table and "| after: server + attached | 4 |" in table
    assert "local / attached time to first token: CLI" in table
    model = json.loads(next(tmp_path.glob("*-quick-resident.json")).read_text())["models"][0]
    assert [m["name"] for m in model["after"]] == ["server", "menubar helper", "notebook kernel", "terminal chat"]
    for setup in ("before_total", "after_total"):
        assert all(model[setup][key] > 0 for key in ("rss", "pss", "uss"))
    assert all(way["ttft_s"]["min"] > 0 for way in model["ttft"].values())
    assert model["ttft"]["cli_attached"]["runs"][0]["cached_tokens"] > 0  # the warm server's prefix cache
    assert not _processes_under(tmp_path)  # every process it started has ended


def _processes_under(folder: Path) -> list[int]:
    """PIDs of live processes whose runtime dir lies under `folder`."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get("MLXINFER_RUNTIME_DIR", "").startswith(str(folder)):
                found.append(process.pid)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            pass
    return found
