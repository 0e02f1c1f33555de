"""Many adapters over one base: 8 greedy streams over 4 LoRA adapters decoded in one batch, against the same streams
run adapter by adapter (a batch of 2 at a time, as a server holding one adapter at once would), and the bare base's
8 streams beside them; plus the weights held against loading the base four times. One run, one process.

The adapters are written here in PEFT's layout (rank 16 on every attention and MLP projection, random nonzero
weights): what they compute does not change the cost, their shapes do.

    python -m bench.adapter_bench [--model PATH] [--rank 16] [--decode 64] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from datetime import date
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

import mlxinfer
from mlxinfer.default_model import default_model_path
from mlxinfer.display import mib
from mlxinfer.speed.conditions import conditions
from mlxinfer.speed.suite import prompt_ids

from .batch_bench import PROMPT_TOKENS, run_level

ADAPTERS, STREAMS = 4, 8
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapters(model: mlxinfer.Model, folder: Path, rank: int) -> dict[str, Path]:
    """ADAPTERS random LoRA adapters over `model`'s projections, saved as PEFT saves them."""
    paths = {}
    layers = {n: m for n, m in model.runtime.decoder.named_modules() if n.endswith(TARGETS)}
    for k in range(ADAPTERS):
        mx.random.seed(k)
        tensors = {}
        for name, module in layers.items():
            out_dims, columns = module.weight.shape
            in_dims = columns * 32 // module.bits if isinstance(module, nn.QuantizedLinear) else columns
            tensors[f"base_model.model.{name}.lora_A.weight"] = mx.random.normal((rank, in_dims)) * 0.02
            tensors[f"base_model.model.{name}.lora_B.weight"] = mx.random.normal((out_dims, rank)) * 0.02
        path = folder / f"tuned{k}"
        path.mkdir()
        mx.save_safetensors(str(path / "adapter_model.safetensors"), tensors)
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}
        (path / "adapter_config.json").write_text(json.dumps(config))
        paths[path.name] = path
    return paths


def measure(path: Path, rank: int, decode: int) -> dict:
    bare = mlxinfer.load(path, prefix_cache_bytes=0)
    with tempfile.TemporaryDirectory() as folder:
        tuned = mlxinfer.load(path, prefix_cache_bytes=0, adapters=write_adapters(bare, Path(folder), rank))
    names = list(tuned.adapters)
    ids = prompt_ids(tuned.tokenizer, PROMPT_TOKENS + 7 * STREAMS)
    run_level(tuned, 2, ids, 4, [tuned.choose_adapter(names[0])] * 2)  # warm-up: thread pools, first allocations
    per_row = [tuned.choose_adapter(names[i % ADAPTERS]) for i in range(STREAMS)]
    together = run_level(tuned, STREAMS, ids, decode, per_row)
    apart = [run_level(tuned, STREAMS // ADAPTERS, ids, decode, [tuned.choose_adapter(n)] * 2) for n in names]
    base = run_level(bare, STREAMS, ids, decode)
    apart_tokens, apart_wall = sum(r["tokens"] for r in apart), sum(r["wall_s"] for r in apart)
    return {
        "together": together,
        "apart": {
            "aggregate_tps": sum(r["aggregate_tps"] for r in apart) / len(apart),
            "wall_s": apart_wall,
            "tokens": apart_tokens,
        },  # fmt: skip
        "bare_base": base,
        "held_bytes": tuned.footprint.weights_bytes,
        "base_bytes": bare.footprint.weights_bytes,
        "rank": rank,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    path = args.model or default_model_path()
    result = measure(path, args.rank, args.decode)
    together, apart, base = result["together"], result["apart"], result["bare_base"]
    runs = {f"{ADAPTERS} adapters in one batch of {STREAMS}": together,
            f"adapter by adapter, {STREAMS // ADAPTERS} at a time": apart,
            f"the bare base, {STREAMS} at once": base}  # fmt: skip
    lines = [
        f"{STREAMS} streams, {args.decode} tokens each, over {ADAPTERS} rank-{args.rank} adapters ({path.name})",
        "| run | aggregate decode tok/s | wall s (all streams) |",
        "|---|---|---|",
        *(f"| {name} | {r['aggregate_tps']:.1f} | {r['wall_s']:.1f} |" for name, r in runs.items()),
        "",
        f"one batch vs adapter by adapter: {together['aggregate_tps'] / apart['aggregate_tps']:.2f}x tok/s, "
        f"{apart['wall_s'] / together['wall_s']:.2f}x sooner; vs the bare base: "
        f"{together['aggregate_tps'] / base['aggregate_tps']:.2f}x",
        f"weights held: {mib(result['held_bytes'])} (base {mib(result['base_bytes'])} + {ADAPTERS} adapters) vs "
        f"{mib(ADAPTERS * result['base_bytes'])} for the base loaded {ADAPTERS} times "
        f"({ADAPTERS * result['base_bytes'] / result['held_bytes']:.2f}x)",
    ]
    report = {"conditions": conditions(), "model": str(path), "decode": args.decode, **result}
    stem = args.out / f"{date.today().isoformat()}-vm-adapters"
    args.out.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1))
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
