"""A GGUF model loaded for running: bytes held against the file's, resident memory, decode speed, and its logits
against the `gguf` package's own dequantization of every tensor.

Each row runs in a process of its own: `--cpu-weights quantized` (the file's blocks as MLX holds them: what a Mac
runs) and `auto` (on a CPU, float32 copies where they measured faster at load). The reference process loads the
same file with every quantized tensor replaced by `gguf.quants.dequantize`'s float32 values (read through our one
GGUF reader, formats/gguf_file.py); the logits compared are every position's for one fixed prompt.

    python -m bench.kquant_bench --gguf gemma-3-270m-q4_k_m.gguf \\
        --gguf ~/.cache/mlxinfer-tests/models/SmolLM2-135M-Instruct.Q4_1.gguf
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

PROMPT = "The capital of France is Paris. def add(a, b):\n    return a + b\nUser: hi! Assistant: Hello,"
DECODE_TOKENS = 32
MODES = ("quantized", "auto")

CHILD = r"""
import json, resource, sys, time
import numpy as np
path, mode, out = sys.argv[1], sys.argv[2], sys.argv[3]
if mode == "reference":  # every quantized tensor as the gguf package dequantizes it, float32
    import gguf
    from mlxinfer.formats import gguf_file
    floats = (gguf_file.F32, gguf_file.F16, gguf_file.BF16)
    read = gguf_file.GGUFFile.read
    def dequantized(self, name):
        info = self.tensors[name]
        if info.ggml_type in floats:
            return read(self, name)
        values = gguf.quants.dequantize(self.raw(name), gguf.GGMLQuantizationType(info.ggml_type))
        return values.astype(np.float32).reshape(info.shape)
    gguf_file.GGUFFile.read = dequantized
import mlx.core as mx
from mlx.utils import tree_flatten
import mlxinfer
model = mlxinfer.load(path, cpu_weights="dense" if mode == "reference" else mode, speculate="off",
                      prefix_cache_bytes=0)
loaded = model._loaded
held = sum(v.nbytes for _, v in tree_flatten(loaded.model.parameters()))
rss_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
ids = model.tokenizer.encode(sys.argv[4])
np.save(out, model.logits(ids))
rates = []
for _ in range(3):
    started = time.perf_counter()
    done = model.generate(sys.argv[4], max_tokens=int(sys.argv[5]), temperature=0)
    rates.append(int(sys.argv[5]) / (time.perf_counter() - started))
print(json.dumps({"held": held, "rss_load": rss_load, "tok_s": max(rates), "kept": loaded.weights.kept,
                  "reason": loaded.weights.reason, "text": str(done)[:40]}))
"""


def run(path: Path, mode: str, logits: Path) -> dict:
    command = [sys.executable, "-c", CHILD, str(path), mode, str(logits), PROMPT, str(DECODE_TOKENS)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{path.name} ({mode}) failed: {done.stderr.strip().splitlines()[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(got, want) -> tuple[float, float, float]:
    """(relative RMS difference, mean KL(reference || got), share of positions whose top token agrees)."""
    import numpy as np

    rel = float(np.sqrt(np.mean((got - want) ** 2)) / np.sqrt(np.mean(want**2)))

    def log_softmax(x):
        x = x - x.max(axis=-1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))

    p, q = log_softmax(want.astype(np.float64)), log_softmax(got.astype(np.float64))
    kl = float(np.mean(np.sum(np.exp(p) * (p - q), axis=-1)))
    return rel, kl, float(np.mean(got.argmax(-1) == want.argmax(-1)))


def file_tensor_bytes(path: Path) -> int:
    from mlxinfer.formats.gguf_file import GGUFFile

    with GGUFFile(path) as f:
        return sum(t.nbytes for t in f.tensors.values())


def main() -> None:
    import tempfile

    import numpy as np

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, action="append", required=True)
    args = parser.parse_args()
    print(f"{platform.machine()} {platform.system()}, {DECODE_TOKENS} greedy tokens best of 3, one process a row")
    print(
        "| file | weights | held | held / file tensors | peak RSS after load | decode tok/s "
        "| logits rel. RMS | KL | top-1 |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        for path in args.gguf:
            tensors = file_tensor_bytes(path)
            reference_logits = Path(scratch) / "reference.npy"
            reference = run(path, "reference", reference_logits)
            want = np.load(reference_logits)
            for mode in MODES:
                logits = Path(scratch) / f"{mode}.npy"
                row = run(path, mode, logits)
                rel, kl, top = compare(np.load(logits), want)
                print(
                    f"| {path.name} | {mode} ({row['kept']}) | {row['held'] / 2**20:,.1f} MiB | "
                    f"{row['held'] / tensors:.3f}x | {row['rss_load'] / 2**20:,.0f} MiB | {row['tok_s']:.2f} | "
                    f"{rel:.4f} | {kl:.5f} | {top:.0%} |"
                )
                print(f"<!-- {mode}: {row['reason']}; answer {row['text']!r} -->")
            print(
                f"| {path.name} | reference (gguf.quants, float32) | {reference['held'] / 2**20:,.1f} MiB | "
                f"{reference['held'] / tensors:.3f}x | {reference['rss_load'] / 2**20:,.0f} MiB | "
                f"{reference['tok_s']:.2f} | 0 | 0 | 100% |"
            )


if __name__ == "__main__":
    main()
