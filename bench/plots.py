"""PNG bar charts of a benchmark report (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def bar_chart(report: dict[str, Any], metric: str, title: str, path: Path) -> Path:
    """Grouped bars: one group per model variant, one bar per engine/mode, whiskers min–max."""
    rows = report["results"]
    labels = list(dict.fromkeys(r["label"] for r in rows))
    series = list(dict.fromkeys((r["engine"], r["mode"]) for r in rows))
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(7, 3.8), dpi=120)
    for i, (engine, mode) in enumerate(series):
        xs, heights, low, high = [], [], [], []
        for j, label in enumerate(labels):
            match = [r for r in rows if (r["engine"], r["mode"], r["label"]) == (engine, mode, label)]
            if match:
                s = match[0][metric]
                xs.append(j + (i - (len(series) - 1) / 2) * width)
                heights.append(s["median"])
                low.append(s["median"] - s["min"])
                high.append(s["max"] - s["median"])
        dtype = next(r["compute_dtype"] for r in rows if (r["engine"], r["mode"]) == (engine, mode))
        ax.bar(xs, heights, width, yerr=[low, high], capsize=3, label=f"{engine} ({mode}, {dtype})")
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("tokens / s")
    c = report["conditions"]
    ax.set_title(f"{title}\n{c['chip']} · {c['backend']} · mlx {c['versions']['mlx']}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
