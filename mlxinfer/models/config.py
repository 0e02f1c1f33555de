"""Normalize a Hugging Face config.json into one form before any model is built.

The classic form (top-level `rope_theta`, `rope_scaling`) and the transformers-5
form (`rope_parameters`, `layer_types`) give the same `ModelConfig`. A setting
that changes the math and that we do not implement raises UnsupportedModelError;
nothing is dropped silently (that is how mlx-lm lost `rope_parameters`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, UnsupportedModelError
from .registry import ARCHITECTURES, ArchSpec, supported_model_types

log = logging.getLogger(__name__)

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class ModelConfig:
    """What the runtime needs to know about a model, independent of file format."""

    model_type: str
    args: dict[str, Any]  # normalized keys handed to mlx-lm's ModelArgs
    layer_types: tuple[str, ...]
    sliding_window: int | None
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    quantization: dict[str, Any] | None
    source: str

    @property
    def spec(self) -> ArchSpec:
        return ARCHITECTURES[self.model_type]

    @property
    def num_layers(self) -> int:
        return int(self.args["num_hidden_layers"])

    @property
    def vocab_size(self) -> int:
        return int(self.args["vocab_size"])

    @property
    def hidden_size(self) -> int:
        return int(self.args["hidden_size"])


def normalize_config(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Validate `raw` and return the single normalized form of it.

    Example:
        >>> cfg = normalize_config(json.load(open("config.json")))
        >>> cfg.args["rope_theta"], cfg.layer_types[:2]
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}")
    _refuse_code_and_foreign_quantization(raw, source)
    model_type = raw.get("model_type")
    if model_type not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"{source}: model_type {model_type!r} is not supported; supported: {', '.join(supported_model_types())}"
        )
    spec = ARCHITECTURES[model_type]
    args = dict(raw)
    _check_types(args, source)
    _check_shapes(args, source, spec)
    _check_activation(args, source, spec)
    _check_neutral(args, source, spec)
    args.update(_rope_args(args, source, spec))
    layer_types, window = _layer_types(args, source, spec)
    # mlx-lm's own mask and cache logic must not see sliding layers: ours builds
    # the per-layer masks (see models/decoder.py).
    args.pop("layer_types", None)
    args["sliding_window"] = None
    tie = bool(raw.get("tie_word_embeddings", spec.tied_by_default))
    args["tie_word_embeddings"] = tie
    return ModelConfig(
        model_type=model_type,
        args=args,
        layer_types=layer_types,
        sliding_window=window,
        tie_word_embeddings=tie,
        eos_token_ids=token_ids(raw.get("eos_token_id")),
        bos_token_id=raw.get("bos_token_id") if isinstance(raw.get("bos_token_id"), int) else None,
        quantization=raw.get("quantization"),
        source=source,
    )


# Keys whose JSON type we rely on; a wrong type is a broken config, not a model variant.
_TYPES: dict[str, tuple[type, ...]] = {
    "hidden_act": (str,),
    "hidden_activation": (str,),
    "head_dim": (int,),
    "layer_types": (list,),
    "sliding_window": (int,),
    "sliding_window_pattern": (int,),
    "max_window_layers": (int,),
    "quantization": (dict,),
    "rope_parameters": (dict,),
    "rope_scaling": (dict,),
    "rope_theta": (int, float),
    "rope_local_base_freq": (int, float),
    "rms_norm_eps": (int, float),
    "partial_rotary_factor": (int, float),
    "tie_word_embeddings": (bool,),
    "use_sliding_window": (bool,),
    "attention_bias": (bool,),
    "mlp_bias": (bool,),
    "max_position_embeddings": (int,),
    "query_pre_attn_scalar": (int, float),
    "attn_logit_softcapping": (int, float),
    "final_logit_softcapping": (int, float),
}


def _check_types(args: dict[str, Any], source: str) -> None:
    for key, types in _TYPES.items():
        value = args.get(key)
        if value is None:
            continue
        is_bool = isinstance(value, bool)
        wrong = not isinstance(value, types) or (is_bool and bool not in types)
        if not wrong and isinstance(value, float) and not math.isfinite(value):
            wrong = True
        if wrong:
            expected = " or ".join(t.__name__ for t in types)
            raise ConfigError(f"{source}: {key} must be a finite {expected}, got {value!r}")
    if args.get("use_bidirectional_attention"):
        raise UnsupportedModelError(f"{source}: use_bidirectional_attention is not supported (causal LMs only)")


def token_ids(value: Any) -> tuple[int, ...]:
    """An `eos_token_id` field (int, list of ints or null) as a tuple."""
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    return tuple(int(v) for v in values if isinstance(v, int) and not isinstance(v, bool))


def _refuse_code_and_foreign_quantization(raw: dict[str, Any], source: str) -> None:
    if "model_file" in raw:
        raise UnsupportedModelError(
            f"{source}: the 'model_file' key asks to run Python code shipped with the model; "
            "mlxinfer never imports code from a model folder. Remove the key to use a built-in architecture."
        )
    if "auto_map" in raw:
        log.warning("%s: ignoring 'auto_map' (mlxinfer never imports code from a model folder)", source)
    qcfg = raw.get("quantization_config")
    if isinstance(qcfg, dict) and "quant_method" in qcfg:
        raise UnsupportedModelError(
            f"{source}: quantization_config.quant_method={qcfg['quant_method']!r} is not supported; "
            "use an unquantized checkpoint or an MLX-quantized folder (mlxinfer convert)"
        )


def _positive_int(args: dict[str, Any], key: str, source: str) -> int:
    value = args.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{source}: {key} must be a positive integer, got {value!r}")
    return value


def _check_shapes(args: dict[str, Any], source: str, spec: ArchSpec) -> None:
    hidden = _positive_int(args, "hidden_size", source)
    heads = _positive_int(args, "num_attention_heads", source)
    for key in ("num_hidden_layers", "intermediate_size", "vocab_size"):
        _positive_int(args, key, source)
    kv_heads = args.setdefault("num_key_value_heads", heads)
    _positive_int(args, "num_key_value_heads", source)
    if heads % kv_heads:
        raise ConfigError(f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    head_dim = args.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise ConfigError(f"{source}: hidden_size={hidden} is not divisible by num_attention_heads={heads}")
        args["head_dim"] = hidden // heads
    elif spec.fixed_head_dim and head_dim * heads != hidden:
        raise UnsupportedModelError(
            f"{source}: head_dim={head_dim} differs from hidden_size/num_attention_heads="
            f"{hidden / heads:g}, which this architecture's implementation assumes"
        )
    eps = args.get("rms_norm_eps", 1e-6)
    if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise ConfigError(f"{source}: rms_norm_eps must be a small positive number, got {eps!r}")


def _check_activation(args: dict[str, Any], source: str, spec: ArchSpec) -> None:
    for key in spec.activation_keys:
        if args.get(key) is not None:
            if args[key] not in spec.activations:
                raise UnsupportedModelError(
                    f"{source}: {key}={args[key]!r} is not supported for {args['model_type']}; "
                    f"expected one of {sorted(spec.activations)}"
                )
            return


def _check_neutral(args: dict[str, Any], source: str, spec: ArchSpec) -> None:
    for key in spec.required:
        if key in args and args[key] is None:
            raise UnsupportedModelError(f"{source}: {key}=null is not supported for {args['model_type']}")
    for key, neutral in spec.neutral.items():
        if key in args and args[key] != neutral:
            raise UnsupportedModelError(
                f"{source}: {key}={args[key]!r} is not supported for {args['model_type']} "
                f"(only {neutral!r}); the result would differ from the reference model"
            )


def _rope_args(args: dict[str, Any], source: str, spec: ArchSpec) -> dict[str, Any]:
    """Read rope settings from either config form into mlx-lm's classic keys."""
    model_type = args["model_type"]
    params = args.get("rope_parameters")
    out: dict[str, Any] = {}
    if model_type == "gemma3_text":
        nested = isinstance(params, dict) and FULL in params
        full = (params.get(FULL) or {}) if nested else (params or {})
        local = (params.get(SLIDING) or {}) if nested else {}
        out["rope_theta"] = full.get("rope_theta", args.get("rope_theta", 1_000_000.0))
        out["rope_local_base_freq"] = local.get("rope_theta", args.get("rope_local_base_freq", 10_000.0))
        out["rope_scaling"] = _scaling(full, source, spec)
        if not nested and args.get("rope_scaling"):
            out["rope_scaling"] = _scaling(args["rope_scaling"], source, spec)
        if _scaling(local, source, spec) is not None:
            raise UnsupportedModelError(f"{source}: rope scaling on sliding layers is not supported")
        return out
    if params is not None:
        out["rope_theta"] = params.get("rope_theta", args.get("rope_theta", 10000.0))
        out["rope_scaling"] = _scaling(params, source, spec)
        if "partial_rotary_factor" in params:
            out["partial_rotary_factor"] = params["partial_rotary_factor"]
    else:
        out["rope_scaling"] = _scaling(args.get("rope_scaling"), source, spec)
    if out.get("partial_rotary_factor", args.get("partial_rotary_factor", 1.0)) != 1.0 and model_type != "phi3":
        raise UnsupportedModelError(f"{source}: partial_rotary_factor is only supported for phi3")
    theta = out.get("rope_theta", args.get("rope_theta"))
    if theta is not None and (not isinstance(theta, (int, float)) or theta <= 0):
        raise ConfigError(f"{source}: rope_theta must be a positive number, got {theta!r}")
    return out


def _scaling(scaling: Any, source: str, spec: ArchSpec) -> dict[str, Any] | None:
    """A rope scaling dict in mlx-lm's form, or None for plain RoPE."""
    if not scaling:
        return None
    if not isinstance(scaling, dict):
        raise ConfigError(f"{source}: rope scaling must be an object, got {scaling!r}")
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type not in spec.rope_types:
        raise UnsupportedModelError(
            f"{source}: rope type {rope_type!r} is not supported here (supported: {', '.join(sorted(spec.rope_types))})"
        )
    if rope_type == "default":
        return None
    factor = scaling.get("factor")
    if not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0:
        raise ConfigError(f"{source}: rope scaling factor must be a positive number, got {factor!r}")
    if rope_type == "llama3":
        needed = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in needed if not isinstance(scaling.get(k), (int, float))]
        if missing:
            raise ConfigError(f"{source}: llama3 rope scaling needs {', '.join(missing)}")
    clean = {k: v for k, v in scaling.items() if k not in ("rope_theta", "partial_rotary_factor")}
    clean["type"] = clean["rope_type"] = rope_type
    return clean


def _layer_types(args: dict[str, Any], source: str, spec: ArchSpec) -> tuple[tuple[str, ...], int | None]:
    n = args["num_hidden_layers"]
    window = args.get("sliding_window")
    declared = args.get("layer_types")
    if declared is not None:
        types = tuple(declared)
    elif spec.sliding == "alternate":
        types = tuple(SLIDING if (i + 1) % 2 else FULL for i in range(n))
    elif spec.sliding == "pattern":
        every = int(args.get("sliding_window_pattern", 6))
        types = tuple(SLIDING if (i + 1) % every else FULL for i in range(n))
    elif spec.sliding == "qwen":
        first = args.get("max_window_layers", n)
        slides = bool(args.get("use_sliding_window")) and window is not None
        types = tuple(SLIDING if slides and i >= first else FULL for i in range(n))
    elif spec.sliding == "all" and window is not None:
        types = (SLIDING,) * n
    else:
        types = (FULL,) * n
    if len(types) != n or not set(types) <= {FULL, SLIDING}:
        raise UnsupportedModelError(
            f"{source}: layer_types must list {n} entries of {FULL!r}/{SLIDING!r}, got {list(types)}"
        )
    if SLIDING in types:
        if not isinstance(window, int) or window <= 0:
            raise ConfigError(f"{source}: sliding layers need a positive sliding_window, got {window!r}")
        return types, window
    return types, None
