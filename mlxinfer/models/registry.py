"""Supported architectures as data: which mlx-lm module builds each, and which
config settings it honours.

A new architecture that differs from an existing one only by flags is a new row
here, never a new model file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .deepseek_config import DEEPSEEK_V3_DEFAULTS, GLM4_MOE_DEFAULTS, check_deepseek_v3, check_glm4_moe
from .dense2026_config import (
    COHERE2_DEFAULTS,
    MINISTRAL3_DEFAULTS,
    SMOLLM3_DEFAULTS,
    check_cohere2,
    check_ministral3,
    check_smollm3,
)
from .exaone4_config import EXAONE4_DEFAULTS, check_exaone4
from .family_config import GPT_OSS_DEFAULTS, GRANITE_DEFAULTS, check_gpt_oss, check_granitemoehybrid, check_olmo2
from .gemma4_config import GEMMA4_DEFAULTS, check_gemma4
from .granite_config import GRANITE3_DEFAULTS, check_granite
from .moe_config import (
    GRANITEMOE_DEFAULTS,
    MIXTRAL_DEFAULTS,
    OLMOE_DEFAULTS,
    QWEN3_5_MOE_DEFAULTS,
    QWEN3_MOE_DEFAULTS,
    check_granitemoe,
    check_mixtral,
    check_olmoe,
    check_qwen3_5_moe,
    check_qwen3_moe,
)
from .olmo3_config import OLMO3_DEFAULTS, check_olmo3
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
    # q_norm/k_norm normalize the whole projection (OLMo), not each head: heads * head_dim wide.
    whole_qk_norm: bool = False
    # Layer types config.json may declare beyond full/sliding attention (recurrent kinds: each
    # gets a fixed-size state cache). Hybrid modules read `layer_types` themselves, so it stays in args.
    recurrent_kinds: frozenset[str] = frozenset()
    # The module picks each layer's block from `layer_types` (no recurrent kinds), so it stays in args too.
    keeps_layer_types: bool = False
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


# Keys transformers' GLM-4.5 / DeepSeek-V3 never read: they always route this way (mlx-lm asserts the method).
_DEEPSEEK_ROUTING = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}

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
    "qwen3_moe": ArchSpec(
        "qwen3_moe",
        sliding="all",  # check_qwen3_moe keeps the window only with use_sliding_window
        rope_types=frozenset({"default"}),  # mlx-lm's module builds a plain RoPE
        neutral={"attention_bias": False},
        renamed={"num_experts": "num_local_experts"},  # transformers 5 writes the second name, mlx-lm reads the first
        defaults=QWEN3_MOE_DEFAULTS,
        check_config=check_qwen3_moe,
        mlx_sanitize=True,
        adapter="moe_layers",
    ),
    # Qwen3.5-MoE's text model (also the text half of model_type "qwen3_5_moe", see multimodal.py).
    "qwen3_5_moe_text": ArchSpec(
        "qwen3_5",
        sliding="declared",
        gated_queries=True,
        recurrent_kinds=frozenset({"linear_attention"}),
        rope_types=frozenset({"default"}),
        partial_rotary=True,
        defaults=QWEN3_5_MOE_DEFAULTS,
        check_config=check_qwen3_5_moe,
        mlx_sanitize=True,
        adapter="qwen3_5_moe_layers",
    ),
    "mixtral": ArchSpec(
        "mixtral",
        sliding="all",
        fixed_head_dim=True,
        rope_types=frozenset({"default"}),  # mlx-lm's module builds a plain RoPE
        renamed={"num_local_experts": "num_experts"},
        defaults=MIXTRAL_DEFAULTS,
        check_config=check_mixtral,
        mlx_sanitize=True,
        adapter="moe_layers",
    ),
    "olmoe": ArchSpec(
        "olmoe",
        fixed_head_dim=True,  # its q_norm spans hidden_size, so transformers too needs heads * head_dim == hidden
        neutral={"clip_qkv": None, "mlp_bias": False},  # mlx-lm never clips; transformers' experts have no bias
        renamed={"num_experts": "num_local_experts"},
        defaults=OLMOE_DEFAULTS,
        check_config=check_olmoe,
        mlx_sanitize=True,
        adapter="moe_layers",
    ),
    "granitemoe": ArchSpec(
        "granitemoe",
        fixed_head_dim=True,
        defaults=GRANITEMOE_DEFAULTS,
        check_config=check_granitemoe,
        mlx_sanitize=True,
        adapter="granitemoe_layers",
    ),
    # ---- MoE families (B: GLM-4.5, DeepSeek-V3 MLA) ----
    # Routing and RoPE as transformers (models/deepseek_layers.py); the router's method is fixed there.
    "glm4_moe": ArchSpec(
        "glm4_moe",
        rope_types=frozenset({"default"}),  # mlx-lm's GLM-4.5 attention ignores rope scaling
        partial_rotary=True,
        neutral=_DEEPSEEK_ROUTING,
        defaults=GLM4_MOE_DEFAULTS,
        check_config=check_glm4_moe,
        mlx_sanitize=True,
        adapter="deepseek_layers",
    ),
    # Multi-head Latent Attention: the cache holds each position's normed latent and rotated key (one "head").
    "deepseek_v3": ArchSpec(
        "deepseek_v3",
        rope_types=frozenset({"default", "yarn"}),
        neutral={**_DEEPSEEK_ROUTING, "moe_layer_freq": 1},  # transformers makes every layer past the dense ones MoE
        defaults=DEEPSEEK_V3_DEFAULTS,
        check_config=check_deepseek_v3,
        mlx_sanitize=True,
        adapter="deepseek_layers",
    ),
    # ---- dense 2026 families (A) ----
    # SmolLM3: llama with NoPE layers (mlx-lm's smollm3 reads no_rope_layers; check_smollm3 fills it).
    "smollm3": ArchSpec(
        "smollm3",
        sliding="declared",  # check_smollm3 writes transformers' layer_types
        tied_by_default=True,
        defaults=SMOLLM3_DEFAULTS,
        check_config=check_smollm3,
    ),
    # Command R7B: parallel attention + MLP, RoPE on sliding layers only, logit_scale (models/cohere2_layers.py).
    "cohere2": ArchSpec(
        "cohere2",
        sliding="pattern",
        fixed_head_dim=True,  # transformers derives head_dim = hidden_size / num_attention_heads
        rope_types=frozenset({"default"}),  # mlx-lm's module builds a plain (interleaved) RoPE
        tied_by_default=True,
        defaults=COHERE2_DEFAULTS,
        check_config=check_cohere2,
        adapter="cohere2_layers",
    ),
    # Ministral 3 (also the text half of model_type "mistral3"): llama blocks plus the llama-4 query scale.
    "ministral3": ArchSpec(
        "llama",
        sliding="all",
        rope_types=frozenset({"default", "linear", "llama3", "yarn"}),
        neutral={"attention_bias": False, "mlp_bias": False},
        defaults=MINISTRAL3_DEFAULTS,
        check_config=check_ministral3,
        adapter="ministral3_layers",
    ),
    # Gemma 4's text model (also the text half of model_type "gemma4"): PLE, KV sharing, per-type head sizes.
    "gemma4_text": ArchSpec(
        "gemma4_text",
        sliding="declared",  # check_gemma4 writes transformers' layer_types
        keeps_layer_types=True,
        neutral={"attention_bias": False},
        defaults=GEMMA4_DEFAULTS,
        check_config=check_gemma4,
        mlx_sanitize=True,
        adapter="gemma4_layers",
        **_GEMMA,
    ),
    # ---- dense 2026 families (B) ----
    # OLMo 2/3: post-norms only, q/k RMSNorm over the whole projection (mlx-lm's modules do both).
    "olmo2": ArchSpec("olmo2", whole_qk_norm=True, defaults={"rms_norm_eps": 1e-5}, check_config=check_olmo2),
    "olmo3": ArchSpec(
        "olmo3",
        whole_qk_norm=True,
        sliding="declared",  # check_olmo3 writes transformers' default layer_types when absent
        rope_types=frozenset({"default", "linear", "llama3", "yarn"}),
        defaults=OLMO3_DEFAULTS,
        check_config=check_olmo3,
        adapter="olmo3_layers",
    ),
    "granite": ArchSpec(
        "granite",
        fixed_head_dim=True,
        defaults=GRANITE3_DEFAULTS,
        check_config=check_granite,
        adapter="granite_layers",
    ),
    # GLM-4-0414: interleaved partial RoPE (mlx-lm's rope_traditional defaults to true), no RoPE scaling.
    "glm4": ArchSpec(
        "glm4",
        rope_types=frozenset({"default"}),
        partial_rotary=True,
        defaults={
            "head_dim": 128,
            "num_key_value_heads": 2,
            "attention_bias": True,
            "partial_rotary_factor": 0.5,
            "rope_theta": 10000.0,
            "rms_norm_eps": 1.5625e-07,
            "max_position_embeddings": 131072,
        },
    ),
    "exaone4": ArchSpec(
        "exaone4",
        sliding="declared",  # check_exaone4 derives layer_types from sliding_window_pattern when absent
        defaults=EXAONE4_DEFAULTS,
        check_config=check_exaone4,
        adapter="exaone4_layers",
    ),
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
