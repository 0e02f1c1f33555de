"""mlx-lm's own learned quantization recipes (AWQ, DWQ, dynamic_quant), scored on heldout_bench's held-out text.

mlx-lm's scripts (`mlx_lm.quant.awq`, `.dwq`, `.dynamic_quant`) download their calibration data from the web at
run time (a calibration text gist for AWQ and dynamic_quant, allenai/tulu-3-sft-mixture for DWQ). Here each
recipe's inner functions are called directly with OUR calibration ids instead, the ones our converter's
`--calibration mixed` uses (convert/calibration.py: half the shipped prose, half the source model's own samples),
cut into sequences of 256 tokens. The outputs are saved with mlx-lm's `save` and scored exactly as
bench/heldout_bench.py scores ours: perplexity change and mean KL(source || output) on code, technical prose and
chat the calibration never saw, so the rows compare with that bench's table.

- awq: `awq_quantize` with mlx-lm's config for the model type, 4-bit g64 layers; the (tied) embedding at 4 bits
  in groups of `--awq-embed-group-size` (mlx-lm's default is 32, 5 bits/weight; 64 here keeps the size at 4.5).
- dwq: the model quantized 4-bit g64 (`quantize_model`), then `dwq_quantize` trains its scales and biases to the
  float model's logits (computed once, in memory, instead of mlx-lm's target files), `--dwq-steps` Adam steps of
  `--dwq-batch-size` sequences each; the validation set is the training sequences themselves. While it trains,
  quantized layers run as dequantize-then-matmul (same values and gradients, through the BLAS: MLX's CPU
  quantized-matmul kernel is ~20x slower than float32 here; `--dwq-mlx-kernels` keeps it).
- dynamic_quant: `estimate_sensitivities` (4-bit g64 low, 5-bit g64 high), then `estimate_threshold` for the
  `--target-bpw` budget, then `quantize_model` with that mix.

Each recipe runs in a subprocess of its own (`--one NAME`), so its time and peak RSS are its own. The recipes
compute in float32 (MLX's CPU runs bf16 about 7x slower; our converter computes in float32 on the CPU too) and
the result is cast back to bfloat16 before saving, as mlx-lm stores it. Bits per weight: 8 * the output's tensor
bytes / the source's parameter count, as our converter reports it.

    python -m bench.peer_recipes_bench [--recipes awq,dwq,dynamic_quant] [--calibration-tokens 1024]
        [--dwq-steps 40] [--dwq-lr 1e-6] [--tokens 512]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import platform
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SOURCE = Path.home() / ".cache" / "mlxinfer" / "bench-models" / "SmolLM2-135M-Instruct-bf16"
RECIPES = ("awq", "dwq", "dynamic_quant")
SEQUENCE = 256  # calibration tokens per sequence
BITS, GROUP = 4, 64
SEED = 123  # mlx-lm's scripts' default


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=SOURCE, help="a float checkpoint folder")
    parser.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated, of: " + ", ".join(RECIPES))
    parser.add_argument("--calibration-tokens", type=int, default=1024, help="mixed calibration ids, all recipes")
    parser.add_argument("--tokens", type=int, default=512, help="held-out tokens scored per kind of text")
    parser.add_argument("--dwq-steps", type=int, default=40, help="DWQ optimizer steps")
    parser.add_argument("--dwq-lr", type=float, default=1e-6, help="DWQ Adam learning rate (mlx-lm's default)")
    parser.add_argument("--dwq-batch-size", type=int, default=4, help="DWQ sequences per step (mlx-lm's default)")
    parser.add_argument(
        "--dwq-mlx-kernels", action="store_true", help="DWQ through MLX's quantized matmul (slow on the CPU)"
    )
    parser.add_argument("--target-bpw", type=float, default=4.75, help="dynamic_quant's bits/weight budget")
    parser.add_argument("--awq-embed-group-size", type=int, default=64, help="AWQ's embedding group size")
    parser.add_argument("--one", choices=RECIPES, help=argparse.SUPPRESS)  # child: run one recipe
    parser.add_argument("--ids", type=Path, help=argparse.SUPPRESS)  # child: calibration ids (JSON)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)  # child: output folder
    return parser.parse_args(argv)


# --- the child: one recipe, in a process of its own ---------------------------------------------------------------


def run_one(args: argparse.Namespace) -> None:
    """Convert `args.source` with recipe `args.one` into `args.out`; write its numbers to out/../result.json."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.utils import compute_bits_per_weight, save

    from mlxinfer import blas
    from mlxinfer.memory.process import peak_rss_bytes

    blas.activate()  # MLX's CPU GEMMs through OpenBLAS, as our converter gets them
    ids = json.loads(args.ids.read_text())
    started = time.perf_counter()
    mx.random.seed(SEED)
    model, tokenizer, config = load(str(args.source), return_config=True)
    model.set_dtype(mx.float32)
    n = len(ids) // SEQUENCE
    batches = mx.array(ids[: n * SEQUENCE], dtype=mx.int32).reshape(n, SEQUENCE)
    model, config, notes = RUNNERS[args.one](model, config, batches, args)
    model.set_dtype(mx.bfloat16)
    mlx_lm_bpw = compute_bits_per_weight(model)
    save(args.out, args.source, model, tokenizer, config)
    result = {"seconds": time.perf_counter() - started, "peak_rss": peak_rss_bytes(), "mlx_lm_bpw": mlx_lm_bpw}
    (args.out.parent / "result.json").write_text(json.dumps(result | notes))


def run_awq(model, config, batches, args):
    from mlx_lm.quant.awq import AWQ_MODEL_CONFIGS, awq_quantize, update_config

    awq_config = AWQ_MODEL_CONFIGS.get(config["model_type"])
    if awq_config is None:
        raise SystemExit(f"mlx-lm's AWQ has no config for model type {config['model_type']!r}")
    embed_group = args.awq_embed_group_size
    awq_quantize(model, batches, awq_config, group_size=GROUP, bits=BITS, embed_group_size=embed_group, embed_bits=4)
    return model, update_config(model, config), {"embed_group_size": embed_group}


def run_dwq(model, config, batches, args):
    import mlx.core as mx
    import mlx.optimizers as optimizers
    from mlx_lm.quant.dwq import dwq_quantize
    from mlx_lm.utils import quantize_model

    rows = [(row, 0) for row in batches.tolist()]  # mlx-lm's data: (tokens, prompt offset)
    target_fn = float_targets(model, batches)
    student = copy.deepcopy(model)
    del model
    _, config = quantize_model(student, config, group_size=GROUP, bits=BITS)
    train = rows * math.ceil(args.dwq_steps * args.dwq_batch_size / len(rows))
    train = train[: args.dwq_steps * args.dwq_batch_size]  # one pass over it: dwq-steps steps
    valid = rows * math.ceil(args.dwq_batch_size / len(rows))  # iterate_batches wants a batch's worth at least
    opt = optimizers.Adam(learning_rate=args.dwq_lr, bias_correction=True)  # as dwq.main builds it
    with contextlib.nullcontext() if args.dwq_mlx_kernels else dense_quantized_matmuls():
        dwq_quantize(
            student, target_fn, opt, train, valid, args.dwq_batch_size, SEQUENCE + 1, SEED, dtype=mx.float32
        )  # max_seq_length SEQUENCE + 1: iterate_batches pads each row to 257, dwq_quantize drops the last column
    return student, config, {"dwq_steps": len(train) // args.dwq_batch_size, "dwq_lr": args.dwq_lr}


@contextlib.contextmanager
def dense_quantized_matmuls():
    """QuantizedLinear and QuantizedEmbedding.as_linear as dequantize-then-matmul while the block runs.

    The same function of the same parameters (mx.dequantize has gradients for scales and biases, equal to
    quantized_matmul's), but the product goes through the BLAS: MLX's CPU quantized-matmul kernel runs a forward
    pass of this model about 20x slower than float32 does, too slow for DWQ's steps here."""
    import mlx.core as mx
    import mlx.nn as nn

    def dense(layer):
        weight, scales, biases = layer["weight"], layer["scales"], layer.get("biases")
        return mx.dequantize(weight, scales, biases, group_size=layer.group_size, bits=layer.bits, mode=layer.mode)

    def linear(self, x):
        y = x @ dense(self).T
        return y + self["bias"] if "bias" in self else y

    saved = nn.QuantizedLinear.__call__, nn.QuantizedEmbedding.as_linear
    nn.QuantizedLinear.__call__ = linear
    nn.QuantizedEmbedding.as_linear = lambda self, x: x @ dense(self).T
    try:
        yield
    finally:
        nn.QuantizedLinear.__call__, nn.QuantizedEmbedding.as_linear = saved


def float_targets(model, batches):
    """dwq_quantize's target_fn: the float model's logits for each calibration row, computed once, looked up by
    the row's tokens (iterate_batches shuffles the batches)."""
    import mlx.core as mx
    import numpy as np

    logits = {}
    for row in batches:
        out = model(row[None])[0]
        mx.eval(out)
        logits[np.array(row).tobytes()] = out

    def target_fn(batch, _index, split):
        return mx.stack([logits[np.array(row, dtype=np.int32).tobytes()] for row in batch])

    return target_fn


def run_dynamic_quant(model, config, batches, args):
    import mlx.core as mx
    from mlx_lm.quant.dynamic_quant import estimate_sensitivities, estimate_threshold
    from mlx_lm.utils import quantize_model

    low, high = (BITS, GROUP), (5, GROUP)  # dynamic_quant.main's defaults
    sensitivities = dict(estimate_sensitivities(model, batches, *low, *high))
    model.set_dtype(mx.bfloat16)  # the budget counts bytes as mlx-lm stores them
    threshold = estimate_threshold(model, sensitivities, args.target_bpw, *low, *high)

    def predicate(path, module):
        if not hasattr(module, "to_quantized"):
            return False
        return {"bits": high[0], "group_size": high[1]} if sensitivities[path] > threshold else True

    model, config = quantize_model(model, config, group_size=GROUP, bits=BITS, quant_predicate=predicate)
    high_layers = sum(s > threshold for s in sensitivities.values())
    return model, config, {"target_bpw": args.target_bpw, "high_layers": high_layers}


RUNNERS = {"awq": run_awq, "dwq": run_dwq, "dynamic_quant": run_dynamic_quant}


# --- the parent: calibration ids once, each recipe in a child, then the scores ------------------------------------


def tensor_bytes_and_params(folder: Path) -> tuple[int, int]:
    """Bytes of all tensors in `folder`'s .safetensors files, and their element count (from the headers)."""
    total = elements = 0
    for file in folder.glob("*.safetensors"):
        with file.open("rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        for name, info in header.items():
            if name != "__metadata__":
                total += info["data_offsets"][1] - info["data_offsets"][0]
                elements += math.prod(info["shape"])
    return total, elements


def write_calibration(source: Path, tokens: int, path: Path) -> int:
    """Our converter's mixed calibration ids for `source`, as JSON at `path`; returns how many."""
    from mlxinfer.convert.calibration import calibration_ids

    from mlxinfer.models.loader import load_model

    ids = calibration_ids(load_model(source), "mixed", tokens)
    path.write_text(json.dumps(ids))
    return len(ids)


def convert_in_child(name: str, args: argparse.Namespace, ids: Path, folder: Path) -> dict:
    """Run recipe `name` in a subprocess (its log on our stderr); its result.json."""
    flags = [
        f"--{k.replace('_', '-')}" + ("" if v is True else f"={v}")
        for k, v in vars(args).items()
        if k not in ("one", "ids", "out", "recipes") and v is not False
    ]
    command = [sys.executable, "-m", "bench.peer_recipes_bench", "--one", name, "--ids", str(ids)]
    subprocess.run([*command, "--out", str(folder / "out"), *flags], stdout=sys.stderr, check=True)
    return json.loads((folder / "result.json").read_text())


def score(name: str, args, source, kinds, ids: Path, params: int) -> str:
    """One markdown row: recipe `name` converted in a child, then scored on each held-out kind."""
    from mlxinfer.quantize import compare_models

    import mlxinfer

    folder = Path(tempfile.mkdtemp(prefix=f"peer-{name}-"))
    try:
        result = convert_in_child(name, args, ids, folder)
        bpw = 8 * tensor_bytes_and_params(folder / "out")[0] / params
        output = mlxinfer.load(folder / "out", cpu_weights="dense")
        reports = {kind: compare_models(source, output, tokens) for kind, tokens in kinds.items()}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"{name}: {json.dumps(result)}", file=sys.stderr)
    cells = [f"{r.ppl_change_pct:+.1f}% / {r.mean_kl:.3f}" for r in reports.values()]
    mean = sum(r.ppl_change_pct for r in reports.values()) / len(reports)
    label = f"{name} (lr {args.dwq_lr:g}, {result['dwq_steps']} steps)" if name == "dwq" else name
    head = f"| {label} | {bpw:.2f} | {result['seconds']:.0f} | {result['peak_rss'] / 2**20:.0f} | "
    return head + " | ".join(cells) + f" | {mean:+.1f}% |"


def conditions(args: argparse.Namespace, calibration: int, kinds: dict[str, list[int]]) -> str:
    import mlx_lm

    return "\n".join(
        (
            f"source {args.source.name}; {platform.node()} ({platform.machine()}, {platform.processor() or '?'}); "
            f"{time.strftime('%Y-%m-%d')}; mlx-lm {mlx_lm.__version__}",
            f"calibration: {calibration} mixed tokens, {calibration // SEQUENCE} x {SEQUENCE} used; "
            f"DWQ {args.dwq_steps} steps x {args.dwq_batch_size} sequences, lr {args.dwq_lr:g}; "
            f"dynamic_quant target {args.target_bpw} bpw; AWQ embedding group {args.awq_embed_group_size}",
            "tokens per kind: " + ", ".join(f"{kind} {len(ids)}" for kind, ids in kinds.items()),
        )
    )


def main() -> None:
    args = parse_args()
    if args.one:
        run_one(args)
        return
    import mlxinfer
    from bench.heldout_bench import texts

    started = time.perf_counter()
    source = mlxinfer.load(args.source, cpu_weights="dense")
    kinds = {kind: ids[: args.tokens] for kind, ids in texts(source).items()}
    params = tensor_bytes_and_params(args.source)[1]
    with tempfile.TemporaryDirectory(prefix="peer-calibration-") as tmp:
        ids = Path(tmp) / "ids.json"
        calibration = write_calibration(args.source, args.calibration_tokens, ids)
        print(conditions(args, calibration, kinds))
        columns = ["recipe", "bits/weight", "convert s", "peak RSS MiB", *(f"{k}: ppl / KL" for k in kinds), "mean ppl"]
        print("\n| " + " | ".join(columns) + " |")
        print("|---|---|---|---|" + "---|" * (len(kinds) + 1), flush=True)
        for name in args.recipes.split(","):
            print(score(name, args, source, kinds, ids, params), flush=True)
    print(f"\nwall time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
