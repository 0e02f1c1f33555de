"""Aggregate decode tokens/s at 1, 2, 4 and 8 streams, through the engine's own scheduler, in one run, with the
next step queued while this one's tokens are handled (pipelined, the default) and without.

Each level submits N greedy requests at once (different prompts, EOS ignored, no prefix cache) to a
ServingThread with max_batch N. The aggregate rate counts only the window in which all N rows decode together:
from the last first token to the first finish. It is set against the bandwidth ceiling (weights read once a
step, plus each row's KV cache), so one figure says how far a level is from the hardware on any backend.

    python -m bench.batch_bench [--model PATH] [--weights auto quantized] [--decode 64] [--rounds 1] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from collections.abc import Sequence
from datetime import date
from pathlib import Path

import mlxinfer
from mlxinfer.adapters import NO_ADAPTER, Chosen
from mlxinfer.default_model import default_model_path
from mlxinfer.engine import Delta, Failed, Finished, Job, SchedulerConfig, ServingThread
from mlxinfer.speed.bandwidth import ceiling_tps, measure_bandwidth
from mlxinfer.speed.conditions import conditions
from mlxinfer.speed.suite import prompt_ids

LEVELS = (1, 2, 4, 8)
PROMPT_TOKENS = 64


def run_level(
    model: mlxinfer.Model, n: int, ids: list[int], decode: int, adapters: Sequence[Chosen] = (), pipelined: bool = True
) -> dict:
    """One level: N requests at once (row i with `adapters[i]`, where given); returns the all-rows-decoding
    window's aggregate rate. `pipelined=False`: each step waits for the last one's tokens to be handled."""
    firsts, lasts, counts, done = [0.0] * n, [0.0] * n, [0] * n, threading.Semaphore(0)
    errors = []

    def on_event(i: int):
        def handle(event) -> None:
            now = time.perf_counter()
            if isinstance(event, Delta) and event.tokens:
                firsts[i] = firsts[i] or now
                counts[i] += event.tokens
                lasts[i] = now
            elif isinstance(event, (Finished, Failed)):
                if isinstance(event, Failed):
                    errors.append(event.error)
                done.release()

        return handle

    scheduler = ServingThread(model.runtime, SchedulerConfig(max_batch=n, pipelined=pipelined))
    try:
        start = time.perf_counter()
        for i in range(n):
            prompt = ids[i * 7 : i * 7 + PROMPT_TOKENS]  # a different prompt per row
            job = Job(prompt_ids=prompt, on_event=on_event(i), max_tokens=decode, eos_token_ids=frozenset(),
                      adapter=adapters[i] if adapters else NO_ADAPTER)  # fmt: skip
            job.use_cache = False
            scheduler.submit(job)
        for _ in range(n):
            done.acquire()
        wall = time.perf_counter() - start
    finally:
        scheduler.stop()
    if errors:
        raise errors[0]
    begin, end = max(firsts), min(lasts)
    # Tokens each row made inside the window, at its own average rate after its first token.
    inside = sum((counts[i] - 1) * (end - begin) / (lasts[i] - firsts[i]) for i in range(n))
    rate = inside / (end - begin)
    return {"streams": n, "aggregate_tps": rate, "wall_s": wall, "tokens": sum(counts), "pipelined": pipelined}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--weights", nargs="+", default=["auto", "quantized"], help="MLXINFER_CPU_WEIGHTS modes")
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1, help="pipelined and unpipelined runs per level, interleaved")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    path = args.model or default_model_path()
    bandwidth = measure_bandwidth().best_gbps
    rows = []
    for mode in args.weights:
        os.environ["MLXINFER_CPU_WEIGHTS"] = mode  # read at load (mlxinfer/models/cpu_weights.py)
        model = mlxinfer.load(path)
        ids = prompt_ids(model.tokenizer, PROMPT_TOKENS + 7 * max(LEVELS))
        run_level(model, 1, ids, 4)  # warm-up: thread pools, first allocations
        footprint = model.footprint
        for n in LEVELS:
            # Off first, then on, at every level: what queueing the next step while this one's tokens are handled
            # buys, side by side (the best of --rounds pairs: other load only slows a run).
            offs, ons = [], []
            for _ in range(args.rounds):
                offs.append(run_level(model, n, ids, args.decode, pipelined=False)["aggregate_tps"])
                ons.append(run_level(model, n, ids, args.decode))
            row = max(ons, key=lambda r: r["aggregate_tps"])
            row["unpipelined_tps"] = max(offs)
            context = PROMPT_TOKENS + args.decode / 2
            steps = ceiling_tps(bandwidth, footprint.decode_weights_bytes, footprint.kv_bytes_per_token * n, context)
            row.update(weights=mode, kept=model._loaded.weights.kept, weights_bytes=footprint.weights_bytes)
            row["ceiling_fraction"] = row["aggregate_tps"] / n / steps
            rows.append(row)
            print(json.dumps(row), flush=True)
        del model
    for mode in args.weights:
        one = next(r for r in rows if r["weights"] == mode and r["streams"] == 1)
        for r in rows:
            if r["weights"] == mode:
                r["vs_batch_1"] = r["aggregate_tps"] / one["aggregate_tps"]
    report = {"conditions": conditions(), "model": str(path), "bandwidth_gbps": bandwidth, "decode": args.decode}
    report["prompt_tokens"], report["rows"] = PROMPT_TOKENS, rows
    stem = args.out / f"{date.today().isoformat()}-vm-batch"
    args.out.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1))
    lines = ["| weights (kept) | streams | aggregate decode tok/s | vs batch 1 | of bandwidth ceiling | unpipelined |"]
    lines.append("|---|---|---|---|---|---|")
    for r in rows:
        gain = r["aggregate_tps"] / r["unpipelined_tps"]
        lines.append(
            f"| {r['weights']} ({r['kept']}) | {r['streams']} | {r['aggregate_tps']:.1f} | {r['vs_batch_1']:.2f}x "
            f"| {r['ceiling_fraction']:.1%} | {r['unpipelined_tps']:.1f} (pipelining: {gain:.2f}x) |"
        )
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
