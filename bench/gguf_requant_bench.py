"""Which MLX affine type each GGUF type that no MLX group holds should be rounded onto (formats/gguf_requant.py).

For every such type: the relative RMS error that rounding its dequantized values onto each MLX affine grid
(2-8 bits, groups of 32/64/128) adds, per row averaged, and the bits per weight each grid holds (codes plus a
16-bit scale and bias per group). The pick is the least error among the grids within 1.1x the source's bits per
weight. Sources: the real Q6_K tensors of a Q4_K_M file when one is given (GEMMA), and random blocks of every type
(bytes below 0x78, so every f16 field is finite): a stand-in for real files of types we have none of.

    python -m bench.gguf_requant_bench [--gguf gemma-3-270m-q4_k_m.gguf]
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from mlxinfer.formats.gguf_file import GGUFFile
from mlxinfer.formats.gguf_requant import REQUANTIZED

GRIDS = [(bits, group) for bits in (2, 3, 4, 5, 6, 8) for group in (32, 64, 128)]
SIZE_BOUND = 1.1


def added_error(values: np.ndarray, bits: int, group: int) -> float:
    w = mx.array(values)
    back = np.array(mx.dequantize(*mx.quantize(w, group_size=group, bits=bits), group_size=group, bits=bits))
    per_row = np.sqrt(((back - values) ** 2).mean(axis=1) / np.maximum((values**2).mean(axis=1), 1e-30))
    return float(per_row.mean())


def random_values(kind: GGMLQuantizationType, rows: int = 2048, cols: int = 256) -> np.ndarray:
    per, size = GGML_QUANT_SIZES[kind]
    raw = np.random.default_rng(int(kind)).integers(0, 0x78, size=(rows, cols // per * size), dtype=np.uint8)
    return dequantize(raw, kind).reshape(rows, cols).astype(np.float32)


def pick(kind: GGMLQuantizationType, values: np.ndarray) -> tuple[tuple[int, int], dict]:
    per, size = GGML_QUANT_SIZES[kind]
    source_bpw = 8 * size / per
    errors = {(bits, group): added_error(values, bits, group) for bits, group in GRIDS}
    fitting = [g for g in GRIDS if g[0] + 32 / g[1] <= SIZE_BOUND * source_bpw] or [(2, 128)]
    return min(fitting, key=errors.__getitem__), {"source_bpw": source_bpw, "errors": errors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, help="a GGUF file with real Q6_K tensors (a Q4_K_M file)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=RuntimeWarning)
    sources = []
    if args.gguf:
        with GGUFFile(args.gguf) as f:
            names = [n for n, t in f.tensors.items() if t.ggml_type == GGMLQuantizationType.Q6_K][:3]
            if names:
                rows = [np.asarray(dequantize(f.raw(n), GGMLQuantizationType.Q6_K)) for n in names]
                sources.append(
                    ("Q6_K (real)", GGMLQuantizationType.Q6_K, np.concatenate([r.reshape(-1, 256) for r in rows]))
                )
    sources += [
        (f"{GGMLQuantizationType(k).name} (random)", GGMLQuantizationType(k), None) for k in sorted(REQUANTIZED)
    ]
    print("| source | bits/weight | pick (bits, group) | its added error | 8-bit g32 | gguf_requant.py |")
    print("|---|---|---|---|---|---|")
    for label, kind, values in sources:
        values = random_values(kind) if values is None else values
        chosen, info = pick(kind, values)
        errors = info["errors"]
        agrees = "same" if REQUANTIZED[int(kind)] == chosen else f"DIFFERS: {REQUANTIZED[int(kind)]}"
        cells = [label, f"{info['source_bpw']:.3f}", chosen, f"{errors[chosen]:.4f}", f"{errors[(8, 32)]:.4f}", agrees]
        print("| " + " | ".join(str(c) for c in cells) + " |")


if __name__ == "__main__":
    main()
