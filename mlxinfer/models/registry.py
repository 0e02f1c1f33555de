"""Supported architectures as data: which mlx-lm module builds each, and which
config settings it honours.

A new architecture that differs from an existing one only by flags is a new row
here, never a new model file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .family_config import GPT_OSS_DEFAULTS, GRANITE_DEFAULTS, check_gpt_oss, check_granitemoehybrid
from .qwen3_next_config import QWEN3_5_DEFAULTS, QWEN3_NEXT_DEFAULTS, check_qwen3_5_text, check_qwen3_next

ROPE_TYPES = frozenset({"default", "linear", "llama3"})


@dataclass(frozen=True)
class ArchSpec:
    """How one Hugging Face `model_type` maps onto mlx-lm's model code."""

    mlx_module: str
    # Config key naming the MLP activation, and the values the module implements.
    activation_keys: tuple[str, ...] = ("hidden_act",)
    activations: frozenset[str] = frozenset({"silu"})
    # How `layer_types` is derived when config.json does not list it (the
    # transformers rules): "none", "all" (every layer slides when sliding_window
    # is set), "alternate" (gemma2: even layers slide), "pattern" (gemma3: every
    # Nth layer is global), "qwen" (use_sliding_window + max_window_layers).
    sliding: str = "none"
    # Gemma multiplies embeddings by sqrt(hidden_size) before the first layer.
    scales_embeddings: bool = False
    # Settings that change the math but that this module ignores: when present
    # and not at their neutral value, loading refuses instead of computing
    # something else than transformers would.
    neutral: dict[str, object] = field(default_factory=dict)
    tied_by_default: bool = False
    # Settings this module always applies, so config.json must give them a value.
    required: tuple[str, ...] = ()
    # RoPE scaling types this module implements like transformers does.
    rope_types: frozenset[str] = ROPE_TYPES
    # mlx-lm's module derives head_dim as hidden_size // heads and ignores the key.
    fixed_head_dim: bool = False
    # The module rotates only the first partial_rotary_factor of each head's dimensions, as transformers does.
    partial_rotary: bool = False
    # q_proj also computes each head's output gate: 2 * num_attention_heads * head_dim outputs.
    gated_queries: bool = False
    # Layer types config.json may declare beyond full/sliding attention (recurrent kinds: each
    # gets a fixed-size state cache). Hybrid modules read `layer_types` themselves, so it stays in args.
    recurrent_kinds: frozenset[str] = frozenset()
    # The backbone's final norm (lfm2 calls it embedding_norm).
    final_norm: str = "norm"
    # mlx-lm argument names the module needs, filled from the transformers key when config.json lacks them.
    renamed: dict[str, str] = field(default_factory=dict)
    # Apply mlx-lm's `Model.sanitize` to the checkpoint's tensors (conv weight layout, stacked experts).
    mlx_sanitize: bool = False
    # transformers' values for keys config.json may leave out, where mlx-lm's default differs or it has none.
    defaults: dict[str, Any] = field(default_factory=dict)
    # Other names config.json may give our layer types (Granite's legacy "mamba"/"attention"), and the
    # names this module's `layer_types` argument uses for ours.
    layer_aliases: dict[str, str] = field(default_factory=dict)
    mlx_layer_names: dict[str, str] = field(default_factory=dict)
    # The family's own checks and rewrites of the args, run after the common size checks (before RoPE and
    # layer types): `check(args, source)`, raising ConfigError / UnsupportedModelError.
    check_config: Callable[[dict[str, Any], str], None] | None = None
    # A module of mlxinfer.models whose `adapt(model, config)` makes mlx-lm's freshly built layers compute
    # what transformers does (and may replace `model.mlx_sanitize`); imported only when such a model is built.
    adapter: str = ""


_GEMMA = dict(
    activation_keys=("hidden_activation", "hidden_act"),
    activations=frozenset({"gelu_pytorch_tanh", "gelu_tanh"}),
    scales_embeddings=True,
    tied_by_default=True,
)

ARCHITECTURES: dict[str, ArchSpec] = {
    "lfm2": ArchSpec(
        "lfm2",
        activation_keys=(),
        sliding="declared",
        recurrent_kinds=frozenset({"conv"}),
        final_norm="embedding_norm",
        renamed={"block_dim": "hidden_size"},
        mlx_sanitize=True,
        tied_by_default=True,
        neutral={"conv_bias": False},
    ),
    "gpt_oss": ArchSpec(
        "gpt_oss",
        activation_keys=(),  # the experts' clamped SwiGLU is fixed; hidden_act is unused
        sliding="alternate",
        rope_types=frozenset({"default", "yarn"}),
        neutral={"attention_bias": True},
        defaults=GPT_OSS_DEFAULTS,
        check_config=check_gpt_oss,
        mlx_sanitize=True,
        adapter="gpt_oss_layers",
    ),
    "granitemoehybrid": ArchSpec(
        "granitemoehybrid",
        sliding="declared",
        recurrent_kinds=frozenset({"mamba"}),
        layer_aliases={"linear_attention": "mamba", "attention": "full_attention"},
        mlx_layer_names={"full_attention": "attention"},
        rope_types=frozenset({"default"}),
        fixed_head_dim=True,
        defaults=GRANITE_DEFAULTS,
        check_config=check_granitemoehybrid,
        mlx_sanitize=True,
        adapter="granitemoehybrid_layers",
    ),
    "qwen3_next": ArchSpec(
        "qwen3_next",
        sliding="declared",  # check_qwen3_next writes layer_types from full_attention_interval when absent
        gated_queries=True,
        recurrent_kinds=frozenset({"linear_attention"}),
        rope_types=frozenset({"default"}),
        partial_rotary=True,
        defaults=QWEN3_NEXT_DEFAULTS,
        check_config=check_qwen3_next,
        mlx_sanitize=True,
        adapter="qwen3_next_layers",
    ),
    # Qwen3.5's text model (also the text half of model_type "qwen3_5", see multimodal.py); mlx-lm has no
    # qwen3_5_text module, its qwen3_5 takes the flat config.
    "qwen3_5_text": ArchSpec(
        "qwen3_5",
        sliding="declared",
        gated_queries=True,
        recurrent_kinds=frozenset({"linear_attention"}),
        rope_types=frozenset({"default"}),
        partial_rotary=True,
        neutral={"num_experts": 0},  # a dense model: mlx-lm would build experts from this key, transformers not
        defaults=QWEN3_5_DEFAULTS,
        check_config=check_qwen3_5_text,
        mlx_sanitize=True,
        adapter="qwen3_next_layers",
    ),
    # ---- MoE families (A) ----
    # ---- MoE families (B: GLM-4.5, DeepSeek-V3 MLA) ----
    # ---- dense 2026 families (A) ----
    # ---- dense 2026 families (B) ----
    "llama": ArchSpec("llama", neutral={"pretraining_tp": 1}),
    "mistral": ArchSpec("llama", sliding="all"),
    "qwen2": ArchSpec("qwen2", sliding="qwen", fixed_head_dim=True),
    "qwen3": ArchSpec("qwen3", sliding="qwen", neutral={"attention_bias": False}),
    "phi3": ArchSpec(
        "phi3", sliding="all", fixed_head_dim=True, rope_types=frozenset({"default"}), partial_rotary=True
    ),
    "gemma2": ArchSpec(
        "gemma2",
        sliding="alternate",
        rope_types=frozenset({"default"}),
        required=("attn_logit_softcapping",),
        **_GEMMA,
    ),
    "gemma3_text": ArchSpec(
        "gemma3_text",
        sliding="pattern",
        neutral={"attn_logit_softcapping": None, "final_logit_softcapping": None},
        **_GEMMA,
    ),
}


def supported_model_types() -> list[str]:
    return sorted(ARCHITECTURES)
