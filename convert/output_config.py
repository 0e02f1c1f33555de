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
    if config.spec.mlx_lm_form is not None:  # keys mlx-lm would misread in their source form
        out.update(config.spec.mlx_lm_form(config))
    out["torch_dtype"] = dtype_name(dtype)
    out.pop("quantization_config", None)
    if settings.bits != 16:
        default = (settings.bits, settings.group_size)
        block: dict[str, Any] = {"group_size": settings.group_size, "bits": settings.bits, "mode": settings.mode}
        for path, quant in sorted(layers.items()):
            mode = getattr(quant, "mode", "affine")  # "mxfp4": GGUF MXFP4 experts kept (layer_bytes.MXFP4Quant)
            if quant is None:
                block[path] = False  # left in float (e.g. inputs not a multiple of the group size)
            elif mode != settings.mode:  # mlx-lm's load() reads the mode off this entry
                block[path] = {"group_size": quant.group_size, "bits": quant.bits, "mode": mode}
            elif (quant.bits, quant.group_size) != default:
                block[path] = {"group_size": quant.group_size, "bits": quant.bits}
        out["quantization"] = block
        out["quantization_config"] = block  # mlx-lm writes both keys
    return out
