"""Benchmark reports as markdown: a conditions line and one row per configuration."""

from __future__ import annotations

from typing import Any

HEADER = (
    "| model | engine | mode | dtype | decode tok/s | prefill tok/s | TTFT cold s | peak MiB | "
    "overhead | of ceiling |\n|---|---|---|---|---|---|---|---|---|---|"
)


def _spread(s: dict[str, float]) -> str:
    return f"{s['median']:.2f} ({s['min']:.2f}–{s['max']:.2f})"


def markdown(report: dict[str, Any]) -> str:
    """A table readers can paste: medians with (min–max), and the conditions they hold under."""
    c, s, bw = report["conditions"], report["settings"], report["bandwidth"]
    lines = [
        f"{c['date']} · {c['chip']} ({c['cores']} cores, {c['memory_bytes'] / 2**30:.0f} GiB) · {c['os']} · "
        f"backend {c['backend']} · mlx {c['versions']['mlx']} · mlx-lm {c['versions']['mlx-lm']} · "
        f"mlxinfer {c['versions']['mlxinfer']}",
        f"prompt {s['prompt_tokens']} tokens, {s['decode_tokens']} decoded (greedy, EOS ignored), "
        f"up to {s['runs']} warm runs within {s['budget_s']:.0f} s per configuration, {s['warmup']}; "
        f"measured read bandwidth {bw['best_gbps']:.1f} GB/s",
        "",
        HEADER,
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['label']} | {r['engine']} | {r['mode']} | {r['compute_dtype']} | {_spread(r['decode_tps'])} | "
            f"{_spread(r['prefill_tps'])} | {r['ttft_cold_s']:.2f} | {r['peak_rss_bytes'] / 2**20:.0f} | "
            f"{r['engine_overhead']:.2f}x | {100 * r['ceiling_fraction']:.1f}% |"
        )
    lines += ["", *ratio_lines(report)]
    return "\n".join(lines)


def ratio_lines(report: dict[str, Any]) -> list[str]:
    """Side-by-side ratios (same run, same files): ours over mlx-lm, per model and mode."""
    rows = report["results"]
    ours = {r["label"]: r for r in rows if r["engine"] == "mlxinfer"}
    out = []
    for r in rows:
        if r["engine"] != "mlx-lm" or r["label"] not in ours:
            continue
        mine = ours[r["label"]]
        decode = mine["decode_tps"]["median"] / r["decode_tps"]["median"]
        prefill = mine["prefill_tps"]["median"] / r["prefill_tps"]["median"]
        out.append(
            f"- {r['label']}: mlxinfer / mlx-lm ({r['mode']}, {r['compute_dtype']}): "
            f"decode {decode:.2f}x, prefill {prefill:.2f}x, "
            f"peak memory {mine['peak_rss_bytes'] / r['peak_rss_bytes']:.2f}x"
        )
    return out
