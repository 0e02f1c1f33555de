"""What mlx-lm's converter does differently per family, applied to our plan.

An mlx-lm model may define `quant_predicate` (the MoE families keep their routers at 8 bits, group 64:
routing picks experts by small logit differences) and `cast_predicate` (Qwen3.5 keeps A_log in its stored
float type). Our runtime runs mlx-lm's modules, so the reference model built from the same arguments
answers for them (the llama-like families define neither: every layer the recipe picks is quantized).
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.nn as nn
from mlxinfer.quantize import LayerQuant

from mlxinfer.models.config import ModelConfig
from mlxinfer.models.mlx_lm_modules import model_module

QuantPredicate = Callable[[str, nn.Module], "bool | dict"]


def mlx_lm_predicates(config: ModelConfig) -> tuple[QuantPredicate | None, Callable[[str], bool] | None]:
    """(quant_predicate, cast_predicate) of mlx-lm's model for `config`, None where it has none."""
    module = model_module(config.spec.mlx_module)
    reference = module.Model(module.ModelArgs.from_dict(config.args))  # lazy parameters: nothing computed
    return getattr(reference, "quant_predicate", None), getattr(reference, "cast_predicate", None)


def apply_quant_predicate(
    layers: dict[str, LayerQuant | None],
    modules: dict[str, nn.Module],
    shapes: dict[str, tuple[int, ...]],
    predicate: QuantPredicate | None,
) -> dict[str, LayerQuant | None]:
    """`layers` with mlx-lm's per-layer verdicts: False keeps a layer in float, a dict sets its format.

    Like mlx-lm, only layers the run quantizes are asked; a format whose groups do not divide the
    layer's inputs leaves the run's format in place."""
    if predicate is None:
        return layers
    chosen = dict(layers)
    for path, quant in layers.items():
        if quant is None:
            continue
        verdict = predicate(path, modules[path])
        if verdict is False:
            chosen[path] = None
        elif isinstance(verdict, dict):
            override = LayerQuant(int(verdict["bits"]), int(verdict["group_size"]))
            inputs = shapes[f"{path}.weight"][-1]
            if inputs % override.group_size == 0:
                chosen[path] = override
    return chosen


ROUTER = LayerQuant(8, 64)  # mlx-lm's format for the routers it keeps finer
_ROUTER_NAMES = ("gate", "router", "router.layer", "shared_expert_gate")


def routers_at_8_bits(
    layers: dict[str, LayerQuant | None], shapes: dict[str, tuple[int, ...]], moe: bool
) -> dict[str, LayerQuant | None]:
    """Every MoE router at 8 bits or finer, also in families whose mlx-lm module has no rule for it
    (mixtral, olmoe): a router's few outputs pick the experts, so its rounding changes which run."""
    if not moe:
        return layers
    chosen = dict(layers)
    for path, quant in layers.items():
        last = path.rsplit(".", 2)
        is_router = last[-1] in _ROUTER_NAMES or ".".join(last[-2:]) in _ROUTER_NAMES
        if is_router and quant is not None and quant.bits < ROUTER.bits:
            inputs = shapes[f"{path}.weight"][-1]
            chosen[path] = ROUTER if inputs % ROUTER.group_size == 0 else None  # else it stays in float
    return chosen
