"""SmolLM3 (SmolLM3ForCausalLM): llama with NoPE layers. mlx-lm's smollm3 module reads no_rope_layers, which
check_smollm3 fills the way transformers' configuration_smollm3.py reads the config; no adapter."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from ..models.config import FULL, MAX_LAYERS, SLIDING
from ..models.registry import ArchSpec
from ..untrusted import is_int, shown

SMOLLM3_DEFAULTS: dict[str, Any] = {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "rope_theta": 2_000_000.0}


def check_smollm3(args: dict[str, Any], source: str) -> None:
    """NoPE layers (no_rope_layers, else every no_rope_layer_interval-th layer) and which layers slide."""
    n = args["num_hidden_layers"]
    flags = args.get("no_rope_layers")
    if flags is None:
        interval = args.get("no_rope_layer_interval", 4)
        if not (is_int(interval) and 0 < interval <= MAX_LAYERS):
            raise ConfigError(f"{source}: no_rope_layer_interval must be a positive integer, got {shown(interval)}")
        flags = [int((i + 1) % interval != 0) for i in range(n)]
    if not (isinstance(flags, list) and len(flags) == n and all(f in (0, 1) for f in flags)):
        raise ConfigError(
            f"{source}: no_rope_layers must list num_hidden_layers={n} entries of 1 (RoPE) or 0 (none), "
            f"got {shown(flags)}"
        )
    args["no_rope_layers"] = [int(f) for f in flags]
    # transformers slides a layer only with use_sliding_window; by default the NoPE layers are the sliding ones.
    slides = bool(args.get("use_sliding_window")) and args.get("sliding_window") is not None
    if not slides:
        args["layer_types"] = [FULL] * n
    elif args.get("layer_types") is None:
        args["layer_types"] = [FULL if rope else SLIDING for rope in args["no_rope_layers"]]


SPECS = {
    "smollm3": ArchSpec(
        "smollm3",
        sliding="declared",  # check_smollm3 writes transformers' layer_types
        tied_by_default=True,
        defaults=SMOLLM3_DEFAULTS,
        check_config=check_smollm3,
    ),
}
