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
from ..formats.safetensors_header import MAX_DIM
from ..untrusted import is_finite_number, is_int, shown
from .fallback import mlx_lm_module_name
from .multimodal import WRAPPERS, text_config
from .registry import ARCHITECTURES, ArchSpec, supported_model_types
from .yarn import yarn_scaling

log = logging.getLogger(__name__)

FULL, SLIDING = "full_attention", "sliding_attention"
ATTENTION = frozenset({FULL, SLIDING})
# Far above any real model (the deepest have ~130 layers), and checked before the
# per-layer tuples below are built; the checkpoint's own tensors then pin the count.
MAX_LAYERS = 10_000
MAX_TOKEN_IDS = 256  # eos ids: a handful in real configs


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
    # The mlx-lm module of a model_type mlxinfer has not verified (models/fallback.py); None when verified.
    fallback_module: str | None = None

    @property
    def verified(self) -> bool:
        return self.fallback_module is None

    @property
    def spec(self) -> ArchSpec:
        if self.fallback_module is not None:  # mlx-lm's module whole, with its own sanitize
            return ArchSpec(self.fallback_module, mlx_sanitize=True)
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
    raw = text_config(raw, source)  # a vision-language checkpoint runs as its text model
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or model_type not in ARCHITECTURES:
        return _unverified_config(raw, source)
    spec = ARCHITECTURES[model_type]
    # transformers 5 writes an infinite float as {"__float__": "Infinity"} (Granite's time_step_limit).
    args = {key: _special_floats(value) for key, value in raw.items()}
    for key, value in spec.defaults.items():
        args.setdefault(key, value)
    for mlx_key, key in spec.renamed.items():
        if args.get(mlx_key) is None and key in args:
            args[mlx_key] = args[key]
    for key in _NULL_IS_DEFAULT:  # transformers reads these with a default, which a null must not defeat
        if key in args and args[key] is None:
            del args[key]
    _check_types(args, source)
    _check_shapes(args, source, spec)
    _check_activation(args, source, spec)
    _check_neutral(args, source, spec)
    if spec.check_config is not None:
        spec.check_config(args, source)
    args.update(_rope_args(args, source, spec))
    _check_numbers(args, source)
    layer_types, window = _layer_types(args, source, spec)
    # mlx-lm's own mask and cache logic must not see sliding layers: ours builds
    # the per-layer masks (see models/decoder.py). Hybrid modules pick each layer's
    # block from layer_types, so they keep it.
    if spec.recurrent_kinds or spec.keeps_layer_types:
        args["layer_types"] = [spec.mlx_layer_names.get(kind, kind) for kind in layer_types]
    else:
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
        eos_token_ids=_token_ids(raw, "eos_token_id", source),
        bos_token_id=next(iter(_token_ids(raw, "bos_token_id", source, many=False)), None),
        quantization=raw.get("quantization"),
        source=source,
    )


def _unverified_config(raw: dict[str, Any], source: str) -> ModelConfig:
    """A model_type mlxinfer has not verified but mlx-lm ships: its module runs whole, labelled unverified.

    Only what the engine itself reads is checked here; mlx-lm's module reads the rest, and the checkpoint's
    tensors must then match the module it builds (loader.verify_weights)."""
    model_type = raw.get("model_type")
    module = mlx_lm_module_name(model_type)
    if module is None:
        raise UnsupportedModelError(
            f"{source}: model_type {shown(model_type)} is not supported (mlx-lm has no module for it either); "
            f"verified: {', '.join(sorted([*supported_model_types(), *WRAPPERS]))}"
        )
    args = {key: _special_floats(value) for key, value in raw.items()}
    _check_types(args, source)
    for key in ("vocab_size", "hidden_size", "num_hidden_layers"):
        value = args.get(key)
        if not (is_int(value) and 0 < value <= (MAX_LAYERS if key == "num_hidden_layers" else MAX_DIM)):
            raise ConfigError(f"{source}: {key} must be a positive integer, got {shown(value)}")
    args.update(_classic_rope_keys(args))
    _check_numbers(args, source)
    return ModelConfig(
        model_type=model_type,
        args=args,
        layer_types=(),  # the module decides; the built model's cache_kinds say what each layer keeps
        sliding_window=None,
        tie_word_embeddings=False,  # the module's own sanitize drops a tied head
        eos_token_ids=_token_ids(raw, "eos_token_id", source),
        bos_token_id=next(iter(_token_ids(raw, "bos_token_id", source, many=False)), None),
        quantization=raw.get("quantization"),
        source=source,
        fallback_module=module,
    )


def _classic_rope_keys(args: dict[str, Any]) -> dict[str, Any]:
    """The top-level keys mlx-lm's modules read, from a transformers-5 `rope_parameters` (mlx-lm 0.32 would
    silently use its default base instead); keys the config sets itself win."""
    rope = args.get("rope_parameters")
    if not isinstance(rope, dict):
        return {}
    classic = {k: rope[k] for k in ("rope_theta", "partial_rotary_factor") if k in rope and k not in args}
    if rope.get("rope_type", "default") != "default" and args.get("rope_scaling") is None:
        classic["rope_scaling"] = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
    return classic


_FLOAT_TAGS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def _special_floats(value: Any, depth: int = 0) -> Any:
    """`value` with transformers' {"__float__": "Infinity"} objects read as floats (a bare `Infinity`, as
    Python's json writes it, already is one); the range checks then judge them like any number."""
    if isinstance(value, dict) and depth < 4:
        tag = value.get("__float__")
        if len(value) == 1 and isinstance(tag, str) and tag in _FLOAT_TAGS:
            return _FLOAT_TAGS[tag]
        return {k: _special_floats(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list) and depth < 4:
        return [_special_floats(v, depth + 1) for v in value]
    return value


# Keys whose JSON type we rely on; a wrong type is a broken config, not a model variant.
_TYPES: dict[str, tuple[type, ...]] = {
    "hidden_act": (str,),
    "hidden_activation": (str,),
    "layer_types": (list,),
    "quantization": (dict,),
    "rope_parameters": (dict,),
    "rope_scaling": (dict,),
    "tie_word_embeddings": (bool,),
    "use_sliding_window": (bool,),
    "attention_bias": (bool,),
    "mlp_bias": (bool,),
    "rope_traditional": (bool,),
}
# Optional numbers and the range where each makes sense (sizes: head_dim and the rest in _check_shapes).
_INT_RANGES: dict[str, tuple[int, int]] = {
    "max_position_embeddings": (1, MAX_DIM),
    "original_max_position_embeddings": (1, MAX_DIM),
    "sliding_window": (1, MAX_DIM),
    "sliding_window_pattern": (1, MAX_LAYERS),
    "max_window_layers": (0, MAX_DIM),
}
# Null in config.json means "the default" for these; for the numbers below that have no "off", null is refused.
_NULL_IS_DEFAULT = ("sliding_window_pattern",)
_NULL_IS_OFF = ("attn_logit_softcapping", "final_logit_softcapping")
# (above, at most): RoPE bases, norm epsilons and soft caps are positive; 0 would divide by zero.
_FLOAT_RANGES: dict[str, tuple[float, float]] = {
    "rms_norm_eps": (0.0, 1.0),
    "rope_theta": (0.0, math.inf),
    "rope_local_base_freq": (0.0, math.inf),
    "partial_rotary_factor": (0.0, 1.0),
    "query_pre_attn_scalar": (0.0, math.inf),
    "attn_logit_softcapping": (0.0, math.inf),
    "final_logit_softcapping": (0.0, math.inf),
}


def _check_types(args: dict[str, Any], source: str) -> None:
    for key, types in _TYPES.items():
        value = args.get(key)
        if value is not None and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
            expected = " or ".join(t.__name__ for t in types)
            raise ConfigError(f"{source}: {key} must be a {expected}, got {shown(value)}")
    # "vision" (Gemma 4): only image tokens see each other; a text prompt stays causal.
    if args.get("use_bidirectional_attention") not in (None, False, "vision"):
        raise UnsupportedModelError(f"{source}: use_bidirectional_attention is not supported (causal LMs only)")


def _check_numbers(args: dict[str, Any], source: str) -> None:
    for key, (low, high) in _INT_RANGES.items():
        value = args.get(key)
        if value is not None and not (is_int(value) and low <= value <= high):
            raise ConfigError(f"{source}: {key} must be an integer from {low} to {high}, got {shown(value)}")
    for key, (above, most) in _FLOAT_RANGES.items():
        value = args.get(key)
        if value is None and key in args and key not in _NULL_IS_OFF:
            raise ConfigError(f"{source}: {key} is null, but the model needs a value (a finite number above {above:g})")
        if value is not None and not (is_finite_number(value) and above < value <= most):
            limit = f" and at most {most:g}" if math.isfinite(most) else ""
            raise ConfigError(f"{source}: {key} must be a finite number above {above:g}{limit}, got {shown(value)}")


def _token_ids(raw: dict[str, Any], key: str, source: str, many: bool = True) -> tuple[int, ...]:
    """The ids in `raw[key]` (null: none), each a token of the vocabulary; anything else is refused."""
    value, vocab = raw.get(key), raw["vocab_size"]
    if value is None:
        return ()
    values = value if many and isinstance(value, list) else [value]
    if len(values) > MAX_TOKEN_IDS:
        raise ConfigError(f"{source}: {key} lists {len(values)} ids, more than {MAX_TOKEN_IDS}")
    bad = [v for v in values if not (is_int(v) and 0 <= v < vocab)]
    if bad:
        kind = "an integer or a list of integers" if many else "an integer"
        raise ConfigError(f"{source}: {key} must be {kind} from 0 to vocab_size-1 ({vocab - 1}), got {shown(bad[0])}")
    return tuple(values)


def _refuse_code_and_foreign_quantization(raw: dict[str, Any], source: str) -> None:
    if "model_file" in raw:
        raise UnsupportedModelError(
            f"{source}: the 'model_file' key asks to run Python code shipped with the model; "
            "mlxinfer never imports code from a model folder. Remove the key to use a built-in architecture."
        )
    if "auto_map" in raw:
        log.warning("%s: ignoring 'auto_map' (mlxinfer never imports code from a model folder)", source)
    qcfg = raw.get("quantization_config")
    if not isinstance(qcfg, dict) or "quant_method" not in qcfg:
        return
    # A family may store some weights in a format MLX runs as it is (ArchSpec.native_quantization).
    spec, method = ARCHITECTURES.get(raw.get("model_type")), qcfg["quant_method"]
    if spec is None or not isinstance(method, str) or method not in spec.native_quantization:
        raise UnsupportedModelError(
            f"{source}: quantization_config.quant_method={shown(qcfg['quant_method'])} is not supported; "
            "use an unquantized checkpoint or an MLX-quantized folder (mlxinfer convert)"
        )


def _positive_int(args: dict[str, Any], key: str, source: str, limit: int = MAX_DIM) -> int:
    value = args.get(key)
    if not is_int(value) or not 0 < value <= limit:
        raise ConfigError(f"{source}: {key} must be a positive integer of at most {limit}, got {shown(value)}")
    return value


def _check_shapes(args: dict[str, Any], source: str, spec: ArchSpec) -> None:
    hidden = _positive_int(args, "hidden_size", source)
    heads = _positive_int(args, "num_attention_heads", source)
    _positive_int(args, "num_hidden_layers", source, limit=MAX_LAYERS)
    intermediate = _positive_int(args, "intermediate_size", source)
    _positive_int(args, "vocab_size", source)
    if args.get("num_key_value_heads") is None:  # absent or null: one key/value head per query head
        args["num_key_value_heads"] = heads
    kv_heads = args["num_key_value_heads"]
    _positive_int(args, "num_key_value_heads", source)
    if heads % kv_heads:
        raise ConfigError(f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    if args.get("head_dim") is None:
        if hidden % heads:
            raise ConfigError(f"{source}: hidden_size={hidden} is not divisible by num_attention_heads={heads}")
        args["head_dim"] = hidden // heads
    head_dim = _positive_int(args, "head_dim", source)
    if spec.fixed_head_dim and head_dim * heads != hidden:
        raise UnsupportedModelError(
            f"{source}: head_dim={head_dim} differs from hidden_size/num_attention_heads="
            f"{hidden / heads:g}, which this architecture's implementation assumes"
        )
    if head_dim % 2:
        raise ConfigError(f"{source}: head_dim={head_dim} must be even (rotary embeddings turn pairs of values)")
    # Fused projections (phi3's qkv_proj and gate_up_proj) are one dimension too: keep it 32-bit.
    fused = {"(num_attention_heads + 2 * num_key_value_heads) * head_dim": (heads + 2 * kv_heads) * head_dim,
             "2 * intermediate_size": 2 * intermediate}  # fmt: skip
    for what, size in fused.items():
        if size > MAX_DIM:
            raise ConfigError(f"{source}: {what} = {size} is more than {MAX_DIM}, the largest dimension MLX has")


def _check_activation(args: dict[str, Any], source: str, spec: ArchSpec) -> None:
    for key in spec.activation_keys:
        if args.get(key) is not None:
            if args[key] not in spec.activations:
                raise UnsupportedModelError(
                    f"{source}: {key}={shown(args[key])} is not supported for {args['model_type']}; "
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
                f"{source}: {key}={shown(args[key])} is not supported for {args['model_type']} "
                f"(only {neutral!r}); the result would differ from the reference model"
            )


def _rope_args(args: dict[str, Any], source: str, spec: ArchSpec) -> dict[str, Any]:
    """Read rope settings from either config form into mlx-lm's classic keys."""
    if spec.rope_args is not None:  # the family reads its own (mlxinfer/families/)
        return spec.rope_args(args, source, spec)
    params = args.get("rope_parameters")
    out: dict[str, Any] = {}
    if params is not None:
        out["rope_theta"] = rope_value(params, "rope_theta", args.get("rope_theta", 10000.0), source)
        out["rope_scaling"] = rope_scaling(params, source, spec, args)
        if "partial_rotary_factor" in params:
            out["partial_rotary_factor"] = rope_value(params, "partial_rotary_factor", 1.0, source)
    else:
        out["rope_scaling"] = rope_scaling(args.get("rope_scaling"), source, spec, args)
    # Qwen's M-RoPE sections ride in either form's RoPE object (Qwen3-VL's Hub configs: rope_scaling, whose default
    # type reads as no scaling); kept under their own key for models/shared_layers.mrope_sections.
    stated = params if params is not None else args.get("rope_scaling")
    if isinstance(stated, dict) and "mrope_section" in stated:
        out["mrope_section"] = stated["mrope_section"]
    if out.get("partial_rotary_factor", args.get("partial_rotary_factor", 1.0)) != 1.0 and not spec.partial_rotary:
        families = ", ".join(sorted(t for t, s in ARCHITECTURES.items() if s.partial_rotary))
        raise UnsupportedModelError(f"{source}: partial_rotary_factor is only supported for {families}")
    return out


def rope_value(params: dict[str, Any], key: str, default: Any, source: str, section: str = "") -> Any:
    """`params[key]`, or `default` when absent; a null there is refused by its full name (a RoPE base has no off)."""
    if key in params and params[key] is None:
        name = ".".join(filter(None, ("rope_parameters", section, key)))
        raise ConfigError(f"{source}: {name} is null, but the model needs a value (a positive number)")
    return params.get(key, default)


def rope_section(params: dict[str, Any], key: str, source: str) -> dict[str, Any]:
    """`params[key]`: one layer type's section of a nested `rope_parameters` ({} when absent)."""
    value = params.get(key) or {}
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: rope_parameters.{key} must be an object, got {shown(value)}")
    return value


def rope_scaling(
    scaling: Any, source: str, spec: ArchSpec, args: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    """A rope scaling dict in mlx-lm's form, or None for plain RoPE."""
    if not scaling:
        return None
    if not isinstance(scaling, dict):
        raise ConfigError(f"{source}: rope scaling must be an object, got {shown(scaling)}")
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if not isinstance(rope_type, str) or rope_type not in spec.rope_types:
        raise UnsupportedModelError(
            f"{source}: rope type {shown(rope_type)} is not supported here "
            f"(supported: {', '.join(sorted(spec.rope_types))})"
        )
    if rope_type == "default":
        return None
    if rope_type == "yarn":  # transformers derives a null factor from the context lengths
        return yarn_scaling(scaling, args or {}, source)
    factor = scaling.get("factor")
    if not is_finite_number(factor) or factor <= 0:
        raise ConfigError(f"{source}: rope scaling factor must be a positive number, got {shown(factor)}")
    if rope_type == "llama3":
        _check_llama3_scaling(scaling, source)
    clean = {k: v for k, v in scaling.items() if k not in ("rope_theta", "partial_rotary_factor")}
    clean["type"] = clean["rope_type"] = rope_type
    return clean


def _check_llama3_scaling(scaling: dict[str, Any], source: str) -> None:
    needed = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in needed if scaling.get(k) is None]
    if missing:
        raise ConfigError(f"{source}: llama3 rope scaling needs {', '.join(missing)}")
    low, high, positions = (scaling[k] for k in needed)
    # The smoothing between the two bands divides by high - low.
    if not (is_finite_number(low) and is_finite_number(high) and 0 < low < high):
        raise ConfigError(
            f"{source}: llama3 rope scaling needs 0 < low_freq_factor < high_freq_factor, "
            f"got {shown(low)} and {shown(high)}"
        )
    if not (is_int(positions) and 0 < positions <= MAX_DIM):
        raise ConfigError(
            f"{source}: rope scaling original_max_position_embeddings must be a positive integer, "
            f"got {shown(positions)}"
        )


def _layer_types(args: dict[str, Any], source: str, spec: ArchSpec) -> tuple[tuple[str, ...], int | None]:
    n = args["num_hidden_layers"]
    window = args.get("sliding_window")
    declared = args.get("layer_types")
    if declared is not None:
        # One past n is enough to refuse a wrong length.
        types = tuple(spec.layer_aliases.get(t, t) if isinstance(t, str) else t for t in declared[: n + 1])
    elif spec.sliding == "declared":
        raise ConfigError(f"{source}: layer_types is missing; {args['model_type']} needs it to know each layer's kind")
    elif spec.sliding == "alternate":
        types = tuple(SLIDING if (i + 1) % 2 else FULL for i in range(n))
    elif spec.sliding == "pattern":
        every = args.get("sliding_window_pattern", 6)
        types = tuple(SLIDING if (i + 1) % every else FULL for i in range(n))
    elif spec.sliding == "qwen":
        first = args.get("max_window_layers", n)
        slides = bool(args.get("use_sliding_window")) and window is not None
        if slides and first is None:
            raise ConfigError(f"{source}: max_window_layers is null, but use_sliding_window needs it (an integer)")
        types = tuple(SLIDING if slides and i >= first else FULL for i in range(n))
    elif spec.sliding == "all" and window is not None:
        types = (SLIDING,) * n
    else:
        types = (FULL,) * n
    kinds = (FULL, SLIDING, *sorted(spec.recurrent_kinds))
    if len(types) != n or not all(t in kinds for t in types):
        raise UnsupportedModelError(
            f"{source}: layer_types must list num_hidden_layers={n} entries of "
            f"{'/'.join(map(repr, kinds))}, got {shown(declared or types)}"
        )
    if SLIDING in types:
        if window is None:
            raise ConfigError(f"{source}: sliding layers need a positive sliding_window, got None")
        return types, window
    return types, None
