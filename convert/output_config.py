"""config.json of a converted model: readable by mlxinfer and by mlx-lm's `load()`.

mlx-lm 0.32 reads only the classic rope keys (it would silently use theta 10000
on a transformers-5 config), so the normalized values are written at the top
level too; `rope_parameters`, when present, says the same thing.
"""

from __future__ import annotations

from typing import Any

from mlxinfer.quantize import LayerQuant

from mlxinfer.models.config import ModelConfig
from mlxinfer.models.dtype import dtype_name

_CLASSIC_ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_local_base_freq", "partial_rotary_factor")


def output_config(
    source_config: dict[str, Any], config: ModelConfig, layers: dict[str, LayerQuant | None], settings: Any, dtype: Any
) -> dict[str, Any]:
    out = dict(source_config)
    out.setdefault("architectures", [config.spec.hf_class or "LlamaForCausalLM"])
    out.update({k: config.args[k] for k in _CLASSIC_ROPE_KEYS if k in config.args})
    # Arguments mlx-lm requires under its own name (lfm2's block_dim): the value mlxinfer derived.
    out.update({k: config.args[k] for k in config.spec.renamed if k in config.args and k not in out})
    out.update(_mlx_lm_form(config))
    out["torch_dtype"] = dtype_name(dtype)
    out.pop("quantization_config", None)
    if settings.bits != 16:
        default = (settings.bits, settings.group_size)
        block: dict[str, Any] = {"group_size": settings.group_size, "bits": settings.bits, "mode": "affine"}
        for path, quant in sorted(layers.items()):
            mode = getattr(quant, "mode", "affine")  # "mxfp4": GGUF MXFP4 experts kept (pipeline.MXFP4Quant)
            if quant is None:
                block[path] = False  # left in float (e.g. inputs not a multiple of the group size)
            elif mode != "affine":  # mlx-lm's load() reads the mode off this entry
                block[path] = {"group_size": quant.group_size, "bits": quant.bits, "mode": mode}
            elif (quant.bits, quant.group_size) != default:
                block[path] = {"group_size": quant.group_size, "bits": quant.bits}
        out["quantization"] = block
        out["quantization_config"] = block  # mlx-lm writes both keys
    return out


def _mlx_lm_form(config: ModelConfig) -> dict[str, Any]:
    """Keys whose source form mlx-lm's `load()` would misread, in the form it reads (and mlxinfer too)."""
    args, kind = config.args, config.model_type
    if kind == "qwen3_5_text":  # mlx-lm has no qwen3_5_text: its qwen3_5 takes a flat text config
        return {"model_type": "qwen3_5"}
    if kind == "qwen3_5_moe_text":  # nor qwen3_5_moe_text: its qwen3_5_moe takes a flat text config too
        return {"model_type": "qwen3_5_moe"}
    if kind == "gemma4_text":  # transformers 5 writes per_layer_config; mlx-lm reads the global layers' sizes here
        return {key: args[key] for key in ("global_head_dim", "num_global_key_value_heads")}
    if kind == "gemma3_text":  # mlx-lm places global layers by pattern only; transformers reads layer_types
        period = _global_period(config.layer_types)
        return {"sliding_window_pattern": period} if period else {}
    if kind == "exaone4" and "sliding_attention" in config.layer_types:  # mlx-lm reads only an L/G string
        return {"sliding_window_pattern": "".join("L" if t == "sliding_attention" else "G" for t in config.layer_types)}
    if kind == "granitemoehybrid":  # the computed values: legacy layer names, a dense model's MLP, NoPE
        return {key: args[key] for key in ("layer_types", "intermediate_size", "position_embedding_type")}
    return {}


def _global_period(layer_types: tuple[str, ...]) -> int | None:
    """N when every Nth layer (and only it) is global, as mlx-lm's `sliding_window_pattern` says; else None."""
    n = next((i + 1 for i, kind in enumerate(layer_types) if kind == "full_attention"), len(layer_types))
    expected = tuple("full_attention" if (i + 1) % n == 0 else "sliding_attention" for i in range(len(layer_types)))
    return n if expected == layer_types else None
