"""mlxinfer against llama.cpp and mlx-lm on one CPU, in one run: prefill and decode at 128/32 and 512/128.

Every engine gets the same prompt token ids (the shipped prose) and decodes greedily with EOS ignored,
each configuration in a fresh process (mlxinfer.speed.runner), one after the other:
- mlxinfer on the GGUF file, as it loads by default (on a CPU: float32 weights where measured faster, OpenBLAS
  on every core but one), with OpenBLAS on every core, and with MLXINFER_CPU_WEIGHTS=quantized (4-bit kernels);
- llama.cpp (llama-cpp-python, built from source: `pip install llama-cpp-python==0.3.36`) on the same GGUF;
- mlx-lm on an MLX 4-bit folder converted from that GGUF (the Q4_1 grid copied, not re-rounded), computing
  in float32 (its bf16 default is ~7x slower on MLX's CPU backend).

    python -m bench.peers_bench [--quick] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from datetime import date
from pathlib import Path

from mlxinfer.convert import convert

from mlxinfer.default_model import default_model_path
from mlxinfer.models import load_tokenizer
from mlxinfer.speed.conditions import conditions
from mlxinfer.speed.measure import RunSpec
from mlxinfer.speed.runner import run_all
from mlxinfer.speed.suite import prompt_ids

SIZES = ((128, 32), (512, 128))


def specs(gguf: Path, folder: Path, ids: list[int], sizes, runs: int) -> list[RunSpec]:
    out = []
    for prompt, decode in sizes:
        common = dict(label=f"{prompt}/{decode}", prompt_ids=ids[:prompt], decode_tokens=decode, runs=runs)
        threads = os.cpu_count() or 1

        def ours(mode: str, common: dict = common, **env: str) -> RunSpec:
            return RunSpec(engine="mlxinfer", model=str(gguf), mode=mode, dtype=None, env=env, **common)

        out += [
            ours("default"),
            ours("quantized", MLXINFER_CPU_WEIGHTS="quantized"),
            ours(f"{threads} BLAS threads", OPENBLAS_NUM_THREADS=str(threads)),
            RunSpec(engine="llama.cpp", model=str(gguf), mode="default", dtype=None, **common),
            RunSpec(engine="mlx-lm", model=str(folder), mode="matched", dtype="float32", **common),
        ]
    return out


def ratios(results: list[dict]) -> list[dict]:
    """mlxinfer's figures over llama.cpp's, per size and mlxinfer mode."""
    rows = []
    for r in results:
        if r["engine"] != "mlxinfer":
            continue
        peer = next(p for p in results if p["engine"] == "llama.cpp" and p["label"] == r["label"])
        mlx_lm = next(p for p in results if p["engine"] == "mlx-lm" and p["label"] == r["label"])
        rows.append(
            {
                "size": r["label"],
                "mlxinfer": r["mode"],
                "prefill_vs_llama_cpp": r["prefill_tps"]["median"] / peer["prefill_tps"]["median"],
                "decode_vs_llama_cpp": r["decode_tps"]["median"] / peer["decode_tps"]["median"],
                "prefill_vs_mlx_lm": r["prefill_tps"]["median"] / mlx_lm["prefill_tps"]["median"],
                "decode_vs_mlx_lm": r["decode_tps"]["median"] / mlx_lm["decode_tps"]["median"],
            }
        )
    return rows


def markdown(report: dict) -> str:
    c = report["conditions"]
    lines = [
        f"# mlxinfer vs llama.cpp vs mlx-lm ({c['date']})",
        "",
        f"{c['chip']}, {c['cores']} cores, {c['memory_bytes'] / 2**30:.0f} GiB, {c['os']}; "
        f"versions {json.dumps(c['versions'])}; BLAS: {c['blas']['name']} ({c['blas']['gflops'] or 0:.0f} GFLOP/s). "
        f"Model: {Path(report['gguf']).name} (mlx-lm: the same weights as an MLX 4-bit folder). "
        f"Greedy, EOS ignored; one cold run per configuration excluded, medians of {report['runs']} warm runs.",
        "",
        "| size | engine | mode | compute | prefill tok/s | decode tok/s | TTFT cold s | weights MiB | peak RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['label']} | {r['engine']} | {r['mode']} | {r['compute_dtype']} | {r['prefill_tps']['median']:.1f} "
            f"| {r['decode_tps']['median']:.1f} | {r['ttft_cold_s']:.2f} | {r['weights_bytes'] / 2**20:.0f} "
            f"| {r['peak_rss_bytes'] / 2**20:.0f} |"
        )
    lines += ["", "| size | mlxinfer | prefill / llama.cpp | decode / llama.cpp | prefill / mlx-lm | decode / mlx-lm |"]
    lines.append("|---|---|---|---|---|---|")
    for r in report["ratios"]:
        lines.append(
            f"| {r['size']} | {r['mlxinfer']} | {r['prefill_vs_llama_cpp']:.2f}x | {r['decode_vs_llama_cpp']:.2f}x "
            f"| {r['prefill_vs_mlx_lm']:.2f}x | {r['decode_vs_mlx_lm']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16/4 tokens, one warm run (checks the harness)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    gguf = default_model_path()
    sizes, runs = (((16, 4),), 1) if args.quick else (SIZES, args.runs)
    ids = prompt_ids(load_tokenizer(gguf), max(p for p, _ in sizes))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "mlx-4bit"
        convert(gguf, folder, bits=4, evaluate=False, progress=False)
        results = [m.to_dict() for m in run_all(specs(gguf, folder, ids, sizes, runs))]
    report = {"conditions": conditions(), "gguf": str(gguf), "runs": runs, "results": results}
    report["ratios"] = ratios(results)
    stem = args.out / f"{date.today().isoformat()}-vm-peers{'-quick' if args.quick else ''}"
    args.out.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1))
    stem.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
