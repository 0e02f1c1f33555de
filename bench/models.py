"""The benchmark's model files: the real SmolLM2-135M-Instruct in bf16, 8-bit and 4-bit.

The bf16 checkpoint is made from the default model's GGUF with transformers (the
reference implementation), the quantized folders with mlx-lm's converter, so both
engines read identical files. Everything is cached under the mlxinfer cache dir.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from mlxinfer.default_model import default_model_path
from mlxinfer.paths import cache_dir

GROUP_SIZE = 64  # mlx_lm.convert's default


def prepare_models(bits: list[str], root: Path | None = None) -> dict[str, Path]:
    """Paths of the requested variants ("bf16", "8", "4"), building missing ones."""
    root = root or cache_dir() / "bench-models"
    source = _bf16_checkpoint(root / "SmolLM2-135M-Instruct-bf16")
    paths = {}
    for b in bits:
        paths[b] = source if b == "bf16" else _quantized(source, _quantized_path(root, b), int(b))
    return paths


def adopt_quantized(folder: Path, bits: str, root: Path | None = None) -> None:
    """Keep `folder`, mlx_lm.convert's output of the bf16 checkpoint at `bits` and GROUP_SIZE (the very call
    `_quantized` makes), as that variant, unless one is there already; `folder` is moved, not copied."""
    out = _quantized_path(root or cache_dir() / "bench-models", bits)
    if (out / "config.json").exists():
        return
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.move(folder, tmp)
    os.replace(tmp, out)


def _quantized_path(root: Path, bits: str) -> Path:
    return root / f"SmolLM2-135M-Instruct-{bits}bit"


def _bf16_checkpoint(out: Path) -> Path:
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = default_model_path()
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
    # Saved as plain bf16 weights: the dequantized GGUF values, no quantizer attached.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(tmp), max_shard_size="150MB")
    tokenizer.save_pretrained(str(tmp))
    _add_classic_rope_keys(tmp / "config.json")
    os.replace(tmp, out)
    return out


def _add_classic_rope_keys(path: Path) -> None:
    # transformers 5 writes only `rope_parameters`; mlx-lm 0.32 reads only the
    # top-level `rope_theta` and would silently use 10000. Keep both forms.
    config = json.loads(path.read_text())
    params = config.get("rope_parameters") or {}
    config.setdefault("rope_theta", params.get("rope_theta", 10000.0))
    path.write_text(json.dumps(config, indent=2))


def _quantized(source: Path, out: Path, bits: int) -> Path:
    if (out / "config.json").exists():
        return out
    from mlx_lm import convert

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    convert(str(source), mlx_path=str(tmp), quantize=True, q_bits=bits, q_group_size=GROUP_SIZE)
    os.replace(tmp, out)
    return out


if __name__ == "__main__":
    # `python -m bench.models`: a local Hugging Face folder for `mlxinfer convert`, made offline
    # from the default model's GGUF (needs the reference extra: transformers and torch).
    print(prepare_models(["bf16"])["bf16"])
