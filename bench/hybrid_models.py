"""The hybrid bench's model files: randomly initialised, realistically SHAPED hybrid checkpoints written by
transformers itself, and the config views mlx-lm needs to read the same weight files.

Speed does not depend on the weights' values, so random weights measure it fairly; they say nothing about
quality. Each shape names its source: real published config values where a small model exists, otherwise a
scaled-down copy of a real one (its head sizes, ratios and layer pattern, fewer and narrower layers).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxinfer.errors import UnsupportedModelError
from mlxinfer.families.gpt_oss import GPT_OSS_YARN
from mlxinfer.paths import cache_dir

TINY = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "tiny"
# The committed tiny checkpoints of the same families (CI and --quick: no torch needed).
TINY_FIXTURES = {
    "lfm2": "lfm2",
    "gemma3_text": "gemma3",
    "qwen3_next": "qwen3_next",
    "qwen3_5_text": "qwen3_5",
    "gpt_oss": "gpt_oss",
    "granitemoehybrid": "granitemoehybrid",
}
# The tiny fixtures' byte-level tokenizer: 256 byte tokens, then <|endoftext|> <|im_start|> <|im_end|>.
BOS_ID, EOS_ID, PAD_ID, FIRST_FREE_ID = 256, 258, 256, 259
WEIGHTS = "model*.safetensors"  # what both engines load (a fixture's golden.safetensors is not a weight)


@dataclass(frozen=True)
class Shape:
    source: str  # where the values come from, printed with the figures
    config: dict[str, Any]  # transformers config arguments, model_type included


def _rope(theta: float, **extra: Any) -> dict[str, Any]:
    return {"rope_theta": theta, "rope_type": "default", **extra}


def _linear_attention_heads() -> dict[str, Any]:
    # Qwen3-Next's Gated DeltaNet head sizes (128) and its 1:2 key:value head ratio, at half the heads.
    return dict(
        linear_num_key_heads=8,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
    )


SHAPES: dict[str, Shape] = {
    "lfm2": Shape(
        "LiquidAI/LFM2-350M config values (block_ff_dim 6656 -> 4608 wide FFN)",
        dict(
            model_type="lfm2",
            vocab_size=65536,
            hidden_size=1024,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=8,
            intermediate_size=6656,
            block_multiple_of=256,
            block_ffn_dim_multiplier=1.0,
            block_auto_adjust_ff_dim=True,
            conv_L_cache=3,
            conv_bias=False,
            norm_eps=1e-5,
            max_position_embeddings=128000,
            rope_parameters=_rope(1e6),
            full_attn_idxs=[2, 5, 8, 10, 12, 14],
            tie_word_embeddings=True,
        ),
    ),
    "gemma3_text": Shape(
        "google/gemma-3-270m config values",
        dict(
            model_type="gemma3_text",
            vocab_size=262144,
            hidden_size=640,
            intermediate_size=2048,
            num_hidden_layers=18,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            query_pre_attn_scalar=256,
            sliding_window=512,
            layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
            rope_parameters={"full_attention": _rope(1e6), "sliding_attention": _rope(1e4)},
            rms_norm_eps=1e-6,
            max_position_embeddings=32768,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3_next": Shape(
        "Qwen3-Next-80B-A3B scaled down: its vocab, head sizes, 3:1 layer pattern; 8 layers, hidden 1024, 16 experts",
        dict(
            model_type="qwen3_next",
            vocab_size=151936,
            hidden_size=1024,
            num_hidden_layers=8,
            layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=256,
            rope_parameters=_rope(1e7, partial_rotary_factor=0.25),
            **_linear_attention_heads(),
            num_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=256,
            shared_expert_intermediate_size=256,
            decoder_sparse_step=1,
            norm_topk_prob=True,
            intermediate_size=1024,
            rms_norm_eps=1e-6,
            max_position_embeddings=262144,
            tie_word_embeddings=False,
        ),
    ),
    "qwen3_5_text": Shape(
        "Qwen3.5-style dense text model (assumed shape): Qwen3-Next's attention, 12 layers, hidden 1024, tied",
        dict(
            model_type="qwen3_5_text",
            vocab_size=151936,
            hidden_size=1024,
            num_hidden_layers=12,
            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 3,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=256,
            rope_parameters=_rope(1e7, partial_rotary_factor=0.25),
            **_linear_attention_heads(),
            intermediate_size=3072,
            rms_norm_eps=1e-6,
            max_position_embeddings=262144,
            tie_word_embeddings=True,
        ),
    ),
    "gpt_oss": Shape(
        "gpt-oss-20b scaled down: its vocab, head_dim 64, 8:1 GQA, 128-token windows, YaRN; 8 layers, hidden 640, "
        "16 experts (top 4)",
        dict(
            model_type="gpt_oss",
            vocab_size=201088,
            hidden_size=640,
            num_hidden_layers=8,
            layer_types=["sliding_attention", "full_attention"] * 4,
            sliding_window=128,
            num_attention_heads=16,
            num_key_value_heads=2,
            head_dim=64,
            num_local_experts=16,
            num_experts_per_tok=4,
            intermediate_size=384,
            attention_bias=True,
            rope_parameters={"rope_theta": 150000.0, **GPT_OSS_YARN},  # gpt-oss's own
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        ),
    ),
    "granitemoehybrid": Shape(
        "Granite-4.0-H-350M-like (partly assumed): 32 layers (28 Mamba-2 + 4 attention), hidden 768, 48 SSM heads, "
        "d_state 128, dense 2048 MLP, no RoPE",
        dict(
            model_type="granitemoehybrid",
            vocab_size=100352,
            hidden_size=768,
            num_hidden_layers=32,
            layer_types=["attention" if i in (10, 13, 17, 27) else "mamba" for i in range(32)],
            num_attention_heads=12,
            num_key_value_heads=4,
            mamba_n_heads=48,
            mamba_d_head=32,
            mamba_d_state=128,
            mamba_n_groups=1,
            mamba_expand=2,
            mamba_d_conv=4,
            mamba_chunk_size=256,
            mamba_conv_bias=True,
            mamba_proj_bias=False,
            num_local_experts=0,
            num_experts_per_tok=0,
            intermediate_size=2048,
            shared_intermediate_size=2048,
            position_embedding_type="nope",
            max_position_embeddings=32768,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
        ),
    ),
}


def prepare_hybrid_models(
    names: list[str] | None = None, root: Path | None = None, tiny: bool = False
) -> dict[str, Path]:
    """Folders of the requested families (default: all), building missing ones (needs torch + transformers).

    With `tiny`, the committed tiny fixtures of the same families instead: nothing is built.
    """
    names = names or list(SHAPES)
    if tiny:
        return {name: TINY / TINY_FIXTURES[name] for name in names}
    root = root or cache_dir() / "bench-models" / "hybrid"
    return {name: _built(name, root / f"{name}-shaped") for name in names}


def _built(name: str, out: Path) -> Path:
    return build_checkpoint(SHAPES[name], out)


def build_checkpoint(shape: Shape, out: Path, dtype: str = "float32") -> Path:
    """`out` holding a random model of `shape` as transformers saves it (in `dtype`), unless it is there already."""
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    arguments = dict(shape.config)
    config = AutoConfig.for_model(
        arguments.pop("model_type"), **arguments, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))  # transformers' own random init
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    write_tokenizer(tmp, config.vocab_size, config.max_position_embeddings)
    os.replace(tmp, out)
    return out


def write_tokenizer(folder: Path, vocab_size: int, max_length: int) -> None:
    """The tiny fixtures' byte-level tokenizer, its vocabulary padded to `vocab_size` so every id the model
    can emit decodes (as `<x123>`: printable ASCII is its own byte-level symbol)."""
    tokenizer = json.loads((TINY / "llama_classic" / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab.update({f"<x{i}>": i for i in range(FIRST_FREE_ID, vocab_size)})
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    config = json.loads((TINY / "llama_classic" / "tokenizer_config.json").read_text())
    config["model_max_length"] = max_length
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def shape_summary(folder: Path) -> dict[str, Any]:
    """What a figure records about its model: type, sizes, layer kinds, parameters and dtype on disk."""
    config = json.loads((folder / "config.json").read_text())
    config = config.get("text_config", config)
    kinds: dict[str, int] = {}
    for kind in config.get("layer_types") or []:
        kinds[kind] = kinds.get(kind, 0) + 1
    params, dtypes = 0, set()
    for path in sorted(folder.glob(WEIGHTS)):
        for name, info in _safetensors_header(path).items():
            if name != "__metadata__":
                params += math.prod(info["shape"])
                dtypes.add(info["dtype"])
    return {
        "model_type": config["model_type"],
        "params": params,
        "hidden_size": config["hidden_size"],
        "layers": config["num_hidden_layers"],
        "layer_types": kinds,
        "vocab_size": config["vocab_size"],
        "dtype_on_disk": "/".join(sorted(dtypes)),
    }


def _safetensors_header(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length))


# ---------------------------------------------------------------------------------------------------------
# mlx-lm views: mlx-lm 0.32.2 cannot read several of these folders as transformers 5 writes them (see each
# fix-up). A view is a sibling folder whose weight and tokenizer files are links to the same files, with a
# config.json mlx-lm understands; mlxinfer always reads the untouched folder.


def mlx_lm_view(folder: Path, out: Path) -> Path:
    """A folder mlx-lm can load holding `folder`'s weights; UnsupportedModelError when there is no such view."""
    config = json.loads((folder / "config.json").read_text())
    fixup = MLX_LM_FIXUPS.get(config["model_type"])
    if fixup is None:
        raise UnsupportedModelError(f"no mlx-lm view for model_type {config['model_type']!r}")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    rewrites_weights = config["model_type"] == "gpt_oss"
    for item in folder.iterdir():
        if item.name != "config.json" and not (rewrites_weights and item.match(WEIGHTS)):
            (out / item.name).symlink_to(item.resolve())
    if rewrites_weights:
        _gpt_oss_weights(folder, out)
    (out / "config.json").write_text(json.dumps(fixup(config), indent=2))
    return out


def _lfm2(config: dict) -> dict:
    return {**config, "block_dim": config["hidden_size"]}  # a required ModelArgs field transformers 5 omits


def _gemma3_text(config: dict) -> dict:
    # mlx-lm reads the window pattern and the two RoPE bases from keys transformers 5 no longer writes.
    rope = config["rope_parameters"]
    return {
        **config,
        "sliding_window_pattern": _full_attention_every(config, "gemma3_text"),
        "rope_theta": rope["full_attention"]["rope_theta"],
        "rope_local_base_freq": rope["sliding_attention"]["rope_theta"],
    }


def _qwen3_next(config: dict) -> dict:
    rope = config["rope_parameters"]
    return {**config, "rope_theta": rope["rope_theta"], "partial_rotary_factor": rope["partial_rotary_factor"]}


def _qwen3_5_text(config: dict) -> dict:
    # mlx-lm has no qwen3_5_text module; its qwen3_5 module takes the flat text config (full attention by interval).
    interval = _full_attention_every(config, "qwen3_5")
    return {**_qwen3_next(config), "model_type": "qwen3_5", "full_attention_interval": interval}


def _full_attention_every(config: dict, module: str) -> int:
    """N where every Nth layer is full attention: mlx-lm places layers by N, not by layer_types."""
    types = config["layer_types"]
    every = types.index("full_attention") + 1
    if any(((i + 1) % every == 0) != (kind == "full_attention") for i, kind in enumerate(types)):
        raise UnsupportedModelError(f"mlx-lm's {module} needs full attention every N layers, got {types}")
    return every


def _qwen3_moe(config: dict) -> dict:
    # transformers 5 writes num_local_experts and rope_parameters; mlx-lm reads num_experts and rope_theta.
    # A folder mlx-lm wrote itself already has both.
    rope = config.get("rope_parameters") or {}
    experts = config.get("num_experts") or config["num_local_experts"]
    return {**config, "num_experts": experts, "rope_theta": config.get("rope_theta") or rope["rope_theta"]}


def _gpt_oss(config: dict) -> dict:
    # mlx-lm reads YaRN from rope_scaling; it always truncates the correction range (transformers does not when
    # truncate is false), so its logits differ somewhat: the speed is still that of the same work.
    return {**config, "rope_scaling": config["rope_parameters"], "rope_theta": config["rope_parameters"]["rope_theta"]}


def _granitemoehybrid(config: dict) -> dict:
    # transformers 5 renames Granite's layer kinds and writes infinity as {"__float__": "Infinity"}.
    names = {"linear_attention": "mamba", "full_attention": "attention"}
    limit = [v if isinstance(v, (int, float)) else float(v["__float__"]) for v in config.get("time_step_limit", [])]
    fixed = {**config, "layer_types": [names.get(t, t) for t in config["layer_types"]]}
    return {**fixed, "time_step_limit": limit} if limit else fixed


MLX_LM_FIXUPS: dict[str, Callable[[dict], dict]] = {
    "lfm2": _lfm2,
    "gemma3_text": _gemma3_text,
    "qwen3_next": _qwen3_next,
    "qwen3_5_text": _qwen3_5_text,
    "gpt_oss": _gpt_oss,
    "granitemoehybrid": _granitemoehybrid,
    "qwen3_moe": _qwen3_moe,
}


def _gpt_oss_weights(folder: Path, out: Path) -> None:
    """transformers' unquantized expert layout in the names and shapes mlx-lm's model holds (its sanitize only
    knows the MXFP4 layout): gate/up de-interleaved from the last axis, every expert matrix as (E, out, in)."""
    import mlx.core as mx

    weights: dict[str, mx.array] = {}
    for path in sorted(folder.glob(WEIGHTS)):
        weights.update(mx.load(str(path)))
    for key in [k for k in weights if k.endswith("experts.gate_up_proj")]:
        base = key.removesuffix("gate_up_proj")
        gate_up = weights.pop(key)  # (E, H, 2I), gate and up interleaved
        bias = weights.pop(base + "gate_up_proj_bias")  # (E, 2I)
        weights[base + "gate_proj.weight"] = gate_up[..., ::2].transpose(0, 2, 1)
        weights[base + "up_proj.weight"] = gate_up[..., 1::2].transpose(0, 2, 1)
        weights[base + "gate_proj.bias"] = bias[..., ::2]
        weights[base + "up_proj.bias"] = bias[..., 1::2]
        weights[base + "down_proj.weight"] = weights.pop(base + "down_proj").transpose(0, 2, 1)  # (E, H, I)
        weights[base + "down_proj.bias"] = weights.pop(base + "down_proj_bias")
    mx.save_safetensors(str(out / "model.safetensors"), {k: mx.contiguous(v) for k, v in weights.items()})


if __name__ == "__main__":
    # `python -m bench.hybrid_models`: build the shaped checkpoints (needs torch + transformers) and print them.
    for family, path in prepare_hybrid_models().items():
        print(family, path, shape_summary(path))
