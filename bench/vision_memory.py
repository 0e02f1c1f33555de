"""What a vision tower holds beyond its weights while it embeds one image, measured, against the formula the
planner admits requests by (each tower config's `activation_bytes`).

Real-size towers with random weights (no download: the shapes decide the memory): SmolVLM-256M's SigLIP (512
pixels), Gemma 3's SigLIP-so400m (896), Gemma 4's encoder (E2B-sized, 280 tokens: 2,520 patches) and Mistral
Small 3.1's Pixtral at a 1,024-pixel square (5,329 patches; its 1,540-pixel limit would be 12,100). Each runs one
frame after its weights are evaluated; the peak of MLX's allocator above that is the measured figure.

    python -m bench.vision_memory        # a few minutes on a 2-core CPU; prints a Markdown table
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_flatten

from mlxinfer.models.gemma4_vision import Gemma4VisionConfig, Gemma4VisionTower
from mlxinfer.models.pixtral import PixtralConfig, PixtralVisionTower
from mlxinfer.models.qwen_vision import QwenVisionConfig, QwenVisionTower
from mlxinfer.models.siglip import SiglipConfig, SiglipVisionTower


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], object]  # the tower, random weights
    pixels: tuple[int, int]  # the frame's height and width
    predicted: Callable[[object, int], int]  # (tower, dtype size) -> the formula's bytes for this frame


def _siglip(config: SiglipConfig) -> Case:
    side = config.image_size
    return Case(f"SigLIP {config.hidden_size}x{config.num_hidden_layers} at {side} px",
                lambda: SiglipVisionTower(config), (side, side),
                lambda tower, size: config.activation_bytes(1, size))  # fmt: skip


def _pixtral(config: PixtralConfig, side: int) -> Case:
    patches = (side // config.patch_size) ** 2
    return Case(f"Pixtral {config.hidden_size}x{config.num_hidden_layers} at {side} px ({patches} patches)",
                lambda: PixtralVisionTower(config), (side, side),
                lambda tower, size: config.activation_bytes(patches, size))  # fmt: skip


def _gemma4(config: Gemma4VisionConfig, rows: int, cols: int) -> Case:
    patches = rows * cols
    side = config.patch_size
    return Case(f"Gemma 4 {config.hidden_size}x{config.num_hidden_layers} ({patches} patches)",
                lambda: Gemma4VisionTower(config), (rows * side, cols * side),
                lambda tower, size: config.activation_bytes(patches, size))  # fmt: skip


def _qwen(config: QwenVisionConfig, side: int) -> Case:
    patches = (side // config.patch_size) ** 2
    return Case(f"Qwen3-VL {config.hidden_size}x{config.depth} at {side} px ({patches} patches)",
                lambda: QwenVisionTower(config, 2), (side, side),
                lambda tower, size: config.activation_bytes(patches, size))  # fmt: skip


CASES = [
    _siglip(SiglipConfig(768, 3072, 12, 12, 512, 16)),  # SmolVLM-256M
    _siglip(SiglipConfig(1152, 4304, 27, 16, 896, 14)),  # Gemma 3 4B-27B
    _gemma4(Gemma4VisionConfig(768, 3072, 16, 12, 12, 64, 16, 3, 10240), 42, 60),  # 280 tokens, 14 x 20
    _pixtral(PixtralConfig(1024, 4096, 24, 16, 14, hidden_act="silu"), 1022),  # Mistral Small 3.1
    # Qwen3-VL-2B's tower (deepstack after blocks 5, 11, 17) at 1,024 pixels a side: 4,096 patches, 1,024 tokens.
    _qwen(QwenVisionConfig(24, 1024, 4096, 16, 16, 2, 2048, 48, deepstack=(5, 11, 17)), 1024),
]


def measure(case: Case, dtype: mx.Dtype) -> dict:
    tower = case.build()
    tower.set_dtype(dtype)
    mx.eval(tower.parameters())
    weights = sum(v.nbytes for _, v in tree_flatten(tower.parameters()))
    height, width = case.pixels
    pixels = mx.random.uniform(shape=(3, height, width)).astype(dtype)
    mx.eval(pixels)
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    start = time.perf_counter()
    out = tower(pixels[None] if isinstance(tower, SiglipVisionTower) else pixels)
    mx.eval(out)
    seconds = time.perf_counter() - start
    measured = mx.get_peak_memory() - before
    predicted = case.predicted(tower, dtype.size)
    return {"case": case.name, "weights": weights, "measured": measured, "predicted": predicted, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--only", default="", help="Run the towers whose name contains this (Gemma 4, Pixtral...).")
    args = parser.parse_args()
    dtype = getattr(mx, args.dtype)
    from mlxinfer import blas

    report = blas.activate()  # MLX's CPU GEMMs through OpenBLAS, as a model load gets them
    print(f"BLAS: {report.name}")
    print(f"{platform.machine()}, {platform.system()}, MLX {mx.__version__} on {mx.default_device()}, {args.dtype}\n")
    print("| tower | weights | measured above weights | formula | formula / measured | seconds |")
    print("|---|---|---|---|---|---|")
    for case in [c for c in CASES if args.only in c.name]:
        row = measure(case, dtype)
        print(f"| {row['case']} | {row['weights'] / 2**20:.0f} MiB | {row['measured'] / 2**20:.0f} MiB | "
              f"{row['predicted'] / 2**20:.0f} MiB | {row['predicted'] / row['measured']:.2f} | "
              f"{row['seconds']:.1f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
