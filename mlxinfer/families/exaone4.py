"""EXAONE 4.0 (Exaone4ForCausalLM): sliding and global layers, RoPE on the sliding ones only.

Which layers slide comes from `layer_types`, else from `sliding_window_pattern`: a number (every Nth layer
is global, transformers' rule) or a string such as "LLLG" (L local, G global, repeated: the real 32B
checkpoint's form, which transformers 5 reads only with layer_types beside it). transformers rotates a
layer's queries and keys only when it slides or when sliding_window is null: check_exaone4 nulls
sliding_window_pattern, so mlx-lm builds RoPE on every layer, and `adapt` switches it off where it must be.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError, UnsupportedModelError
from ..models.config import FULL, SLIDING, ModelConfig
from ..models.decoder import DecoderLM
from ..models.registry import ArchSpec
from ..untrusted import is_int, shown

# Exaone4Config's defaults (transformers 5) for keys config.json may leave out.
EXAONE4_DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": 32,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "sliding_window": 4096,
}
_LETTERS = {"L": SLIDING, "G": FULL}


def check_exaone4(args: dict[str, Any], source: str) -> None:
    window = args.get("sliding_window")
    if args.get("layer_types") is None:
        args["layer_types"] = _derived_layer_types(args, window, source)
    # Folded into layer_types. With it null mlx-lm builds RoPE on every layer; the adapter removes it
    # where transformers has none (and our masks, not mlx-lm's pattern, pick each layer's window).
    args["sliding_window_pattern"] = None
    if window is not None and SLIDING not in args["layer_types"]:
        raise UnsupportedModelError(
            f"{source}: sliding_window={shown(window)} but no layer slides, so transformers would run every "
            "layer without RoPE; set sliding_window to null for a model whose layers all attend globally"
        )


def _derived_layer_types(args: dict[str, Any], window: Any, source: str) -> list[str]:
    n = args["num_hidden_layers"]
    if window is None:
        return [FULL] * n
    pattern = args.get("sliding_window_pattern", 4)
    if isinstance(pattern, str) and pattern and set(pattern) <= set(_LETTERS):
        return [_LETTERS[pattern[i % len(pattern)]] for i in range(n)]
    if is_int(pattern) and pattern > 0:
        return [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    raise ConfigError(
        f"{source}: sliding_window_pattern must be a positive integer or a string of L and G "
        f"(or give layer_types), got {shown(pattern)}"
    )


def adapt(model: DecoderLM, config: ModelConfig) -> None:
    hybrid = config.sliding_window is not None
    for layer, kind in zip(model.layers, config.layer_types):
        layer.self_attn.use_rope = not hybrid or kind == SLIDING


def mlx_lm_form(config: ModelConfig) -> dict[str, Any]:
    """mlx-lm reads sliding layers only from an L/G string (`sliding_window_pattern`)."""
    if SLIDING not in config.layer_types:
        return {}
    return {"sliding_window_pattern": "".join("L" if t == SLIDING else "G" for t in config.layer_types)}


SPECS = {
    "exaone4": ArchSpec(
        "exaone4",
        mlx_lm_form=mlx_lm_form,
        sliding="declared",  # check_exaone4 derives layer_types from sliding_window_pattern when absent
        defaults=EXAONE4_DEFAULTS,
        check_config=check_exaone4,
        adapt=adapt,
    ),
}
