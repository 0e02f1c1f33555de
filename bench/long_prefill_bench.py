"""Long prompts: prefill time and peak memory at 1k, 8k and 32k tokens, mlxinfer against mlx-lm, in one run (issue 37
item 3).

The model has SmolLM2-135M's layers at real size: 30 of them, 576 wide, 9 query and 3 key/value heads of 64, an
MLP of 1536 (random weights, float32, written with NumPy by host_bench.prepare_fixture). Its vocabulary is the tiny
fixtures' byte-level one, padded to 512 ids: a 49k head would add the same fixed cost per chunk to both engines and
hide the attention and cache work that grows with the prompt. The prompt is random ids (no special token).

Both engines run MLX's CPU GEMMs through the same BLAS (mlxinfer/blas.py routes OpenBLAS in on Linux; without
it mlx-lm's float32 prefill here is ten times slower, which is not what this bench is about).
Each (engine, length) run is a process of its own, so its peak memory is its own. The runs interleave, engine after
engine, and each keeps its best time (other work on a shared machine only slows a run).
- mlxinfer: `Model.generate(ids, max_tokens=1, use_cache=False, speculate="off")` with its default prefill chunk
  (512). A request's caches are sized for its prompt when it is admitted, so the prefill copies no history.
- mlx-lm: `stream_generate(model, tokenizer, ids, max_tokens=1)` with its default prefill step (2048). Its KVCache
  grows by concatenation, 256 positions at a time.

Time is from the call to the first token: the whole prefill and one sampling. Memory is MLX's peak over that call
(`mx.get_peak_memory` after `mx.reset_peak_memory`), weights included, the process's peak RSS, and (in the JSON)
what MLX's buffer cache holds after the call (`mx.get_cache_memory`).

    python -m bench.long_prefill_bench [--lengths 1024 8192 32768] [--runs 2] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxinfer.speed.conditions import conditions, described

from .host_bench import RESULTS, SPECIAL_IDS, prepare_fixture, save_report
from .hybrid_models import Shape

SHAPE = Shape(
    "SmolLM2-135M's 30 layers (576 wide, 9 + 3 heads of 64, MLP 1536), 512 byte-level ids, random weights, float32",
    {
        "model_type": "llama", "vocab_size": 512, "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "max_position_embeddings": 40960, "tie_word_embeddings": True, "rope_theta": 100000.0,
    },
)  # fmt: skip
FIXTURE = "long-prefill-llama-576x30-v512"
ENGINES = ("mlxinfer", "mlx-lm")
WARM_UP = 64  # prompt tokens of the run before the timed one: compiles kernels, reads the weights in


def prompt_ids(length: int) -> list[int]:
    allowed = np.setdiff1d(np.arange(SHAPE.config["vocab_size"]), SPECIAL_IDS)
    return np.random.default_rng(length).choice(allowed, size=length).tolist()


def one(engine: str, length: int, folder: Path) -> dict[str, Any]:
    """One engine's prefill of `length` tokens in this process: seconds, MLX's peak bytes, peak RSS bytes."""
    from mlxinfer import blas

    blas.activate()  # MLX's CPU GEMMs through OpenBLAS for both engines, as mlxinfer's model load routes them
    ids = prompt_ids(length)
    if engine == "mlxinfer":
        import mlxinfer

        model = mlxinfer.load(folder, dtype="float32", speculate="off", prefix_cache_bytes=0)

        def run(prompt: list[int]) -> None:
            model.generate(prompt, max_tokens=1, use_cache=False)
    else:
        import mlx_lm
        from mlx_lm import stream_generate

        model, tokenizer = mlx_lm.load(str(folder))

        def run(prompt: list[int]) -> None:
            for _ in stream_generate(model, tokenizer, prompt, max_tokens=1):
                pass

    run(ids[:WARM_UP])
    mx.reset_peak_memory()
    start = time.perf_counter()
    run(ids)
    seconds = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    held = {"mlx_peak_bytes": mx.get_peak_memory(), "mlx_cache_bytes_after": mx.get_cache_memory()}
    return {"seconds": seconds, **held, "rss_peak_bytes": rss}


def in_process(engine: str, length: int, folder: Path) -> dict[str, Any]:
    command = [sys.executable, "-m", "bench.long_prefill_bench", "--one", engine, str(length), str(folder)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=Path(__file__).parent.parent)
    if done.returncode != 0:
        raise SystemExit(f"long prefill bench: {engine} at {length} tokens failed: {done.stderr[-800:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(lengths: list[int], runs: int, folder: Path) -> dict[int, dict[str, dict[str, Any]]]:
    """Per length and engine: the best time of `runs` interleaved runs, and the peaks of that run."""
    best: dict[int, dict[str, dict[str, Any]]] = {length: {} for length in lengths}
    for _ in range(runs):
        for length in lengths:
            for engine in ENGINES:
                result = in_process(engine, length, folder)
                kept = best[length].get(engine)
                if kept is None or result["seconds"] < kept["seconds"]:
                    best[length][engine] = {**result, "all_seconds": (kept or {}).get("all_seconds", [])}
                best[length][engine]["all_seconds"].append(result["seconds"])
                print(f"{engine} {length}: {result['seconds']:.2f} s", file=sys.stderr, flush=True)
    return best


def markdown(report: dict[str, Any]) -> str:
    rows = [
        f"{described(report['conditions'])}; BLAS {report['conditions']['blas']['name']}; {report['model']}; "
        f"best of {report['runs']} interleaved runs, each in a process of its own; load average at start "
        f"{report['load_average_at_start'][0]:.1f}",
        "",
        "| prompt tokens | mlxinfer s (tok/s) | mlx-lm s (tok/s) | mlxinfer speed vs mlx-lm | MLX peak: mlxinfer / "
        "mlx-lm | peak RSS: mlxinfer / mlx-lm |",
        "|---|---|---|---|---|---|",
    ]
    for length, by_engine in report["by_length"].items():
        ours, theirs = by_engine["mlxinfer"], by_engine["mlx-lm"]
        cells = [f"{r['seconds']:.2f} ({int(length) / r['seconds']:.0f})" for r in (ours, theirs)]
        peaks = [
            " / ".join(f"{r[key] / 2**20:,.0f} MiB" for r in (ours, theirs))
            for key in ("mlx_peak_bytes", "rss_peak_bytes")
        ]
        ratio = theirs["seconds"] / ours["seconds"]
        rows.append(f"| {int(length):,} | {cells[0]} | {cells[1]} | {ratio:.2f}x | {peaks[0]} | {peaks[1]} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--one", nargs=3, metavar=("ENGINE", "LENGTH", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        engine, length, folder = args.one
        print(json.dumps(one(engine, int(length), Path(folder))))
        return
    load_average = os.getloadavg()
    folder = prepare_fixture(shape=SHAPE, name=FIXTURE)
    report = {
        "conditions": conditions(),
        "load_average_at_start": load_average,
        "model": SHAPE.source,
        "runs": args.runs,
        "by_length": measure(args.lengths, args.runs, folder),
    }
    save_report(args.out, "long-prefill", report, markdown(report))


if __name__ == "__main__":
    main()
