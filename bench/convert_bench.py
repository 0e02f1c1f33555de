"""Converter figures: mlxinfer convert vs mlx_lm.convert on the same multi-shard checkpoint.

Each conversion runs in its own process (wall time and peak RSS are its own);
quality is the perplexity gap to the source, measured by one runtime on the same
tokens for every output.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MLX_LM = "mlx-lm (default, 4-bit g64)"
PEAK = "from mlxinfer.memory import peak_rss_bytes; print('PEAK', peak_rss_bytes())"
CONVERTERS = {
    MLX_LM: (
        "from mlx_lm import convert; import sys; convert(sys.argv[1], mlx_path=sys.argv[2], quantize=True, "
        "q_bits=4, q_group_size=64)"
    ),
    "mlxinfer (uniform, 4-bit g64)": (
        "from mlxinfer.convert import convert; import sys; convert(sys.argv[1], sys.argv[2], bits=4, group_size=64, "
        "evaluate=False, progress=False)"
    ),
    "mlxinfer (GPTQ, 4-bit g64)": (
        "from mlxinfer.convert import convert; import sys; convert(sys.argv[1], sys.argv[2], bits=4, group_size=64, "
        "method='gptq', evaluate=False, progress=False)"
    ),
    "mlxinfer (sensitivity + GPTQ, 4.75 bpw g64)": (
        "from mlxinfer.convert import convert; import sys; convert(sys.argv[1], sys.argv[2], bits=4, group_size=64, "
        "recipe='sensitivity', bpw=4.75, evaluate=False, progress=False)"
    ),
}


def run_convert_bench(source: Path, work: Path, eval_tokens: int, quick: bool = False) -> dict[str, Any]:
    """Wall time, peak RSS, bits per weight, perplexity gap and KL for each converter."""
    from mlxinfer.quantize import compare_models

    import mlxinfer
    from mlxinfer.data import prose_text
    from mlxinfer.speed.conditions import conditions

    work.mkdir(parents=True, exist_ok=True)
    converters = list(CONVERTERS.items())[:2] if quick else list(CONVERTERS.items())  # quick: no sensitivity pass
    rows, outputs = [], []
    for name, code in converters:
        out = output_folder(work, name)
        wall, peak = _timed_conversion(code, source, out)
        outputs.append(out)
        rows.append(
            {"converter": name, "wall_s": wall, "peak_rss_bytes": peak, "bits_per_weight": _bits_per_weight(out)}
        )
    # Quality after all timings, so no evaluation runs beside a measured conversion.
    reference = mlxinfer.load(source)
    ids = reference.tokenizer.encode(prose_text(), add_special_tokens=False)[:eval_tokens]
    reports = [compare_models(reference, mlxinfer.load(out), ids) for out in outputs]
    for row, report in zip(rows, reports):
        row.update(ppl=report.output_ppl, ppl_gap_pct=report.ppl_change_pct, mean_kl=report.mean_kl)
    return {
        "conditions": conditions(),
        "source": str(source),
        "eval_tokens": len(ids),
        "source_ppl": reports[0].source_ppl,
        "rows": rows,
    }


def output_folder(work: Path, converter: str) -> Path:
    """Where run_convert_bench(source, work, ...) leaves `converter`'s output."""
    return work / f"out-{list(CONVERTERS).index(converter)}"


def _timed_conversion(code: str, source: Path, out: Path) -> tuple[float, int]:
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", f"{code}; {PEAK}", str(source), str(out)], capture_output=True, text=True, check=False
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"conversion failed: {done.stderr.strip().splitlines()[-1:]}")
    peak = next(int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("PEAK "))
    return wall, peak


def _bits_per_weight(folder: Path) -> float:
    """Stored bits over weights, from the safetensors headers and the quantization block."""
    from mlxinfer.formats.safetensors_header import read_header

    quant = json.loads((folder / "config.json").read_text()).get("quantization") or {}
    stored_bits = weights = 0
    for file in sorted(folder.glob("model*.safetensors")):
        for name, info in read_header(file).items():
            count = 1
            for d in info.shape:
                count *= d
            item_bits = 32 if info.dtype in ("U32", "F32") else 16
            stored_bits += count * item_bits
            if name.endswith((".scales", ".biases")):
                continue
            layer = quant.get(name.removesuffix(".weight"))
            bits = (layer or quant).get("bits", 32) if info.dtype == "U32" else 32
            weights += count * 32 // bits if info.dtype == "U32" else count
    return stored_bits / weights


def markdown(figures: dict[str, Any]) -> str:
    base = next(r for r in figures["rows"] if r["converter"].startswith("mlx-lm"))
    c = figures["conditions"]
    lines = [
        f"Converter: {figures['source']} -> 4-bit; perplexity on {figures['eval_tokens']} tokens of prose.txt "
        f"(source {figures['source_ppl']:.3f}), each conversion in its own process.",
        f"{c['date']} · {c['chip']} ({c['cores']} cores, {c['memory_bytes'] / 2**30:.0f} GiB) · {c['os']} · "
        f"mlx {c['versions']['mlx']} · mlx-lm {c['versions']['mlx-lm']} · mlxinfer {c['versions']['mlxinfer']}",
        "",
        "| converter | wall s | x mlx-lm | peak RSS MiB | x mlx-lm | bits/weight | ppl gap | mean KL |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in figures["rows"]:
        lines.append(
            f"| {r['converter']} | {r['wall_s']:.1f} | {r['wall_s'] / base['wall_s']:.2f} | "
            f"{r['peak_rss_bytes'] / 2**20:.0f} | {r['peak_rss_bytes'] / base['peak_rss_bytes']:.2f} | "
            f"{r['bits_per_weight']:.2f} | {r['ppl_gap_pct']:+.2f}% | {r['mean_kl']:.3f} |"
        )
    return "\n".join(lines)
