"""Supported architectures as data: which mlx-lm module builds each, and which config settings it honours.

Each family's row lives in its own file, `mlxinfer/families/<model_type>.py`, with its defaults, config
checks, layer adapters and weight renames. This module finds a family by its model_type, importing that one
file by name the first time it is asked for (as mlx-lm does), so nothing here imports a family statically.
A new architecture that differs from an existing one only by flags is a new file of a few lines.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import ModelConfig
    from .decoder import DecoderLM

FAMILIES_PACKAGE = "mlxinfer.families"
_FAMILIES_FOLDER = Path(__file__).resolve().parents[1] / "families"
# Model types whose rows sit in a close variant's file (they share its checks and layer adapters).
SHARED_FILES = {
    "mistral": "llama",  # llama's blocks on mlx-lm's llama module, every layer sliding
    "olmo2": "olmo3",  # OLMo 3 is OLMo 2 with sliding layers
    "qwen3_5_text": "qwen3_next",  # Qwen3.5: Qwen3-Next's Gated DeltaNet hybrid without experts
    "qwen3_5_moe_text": "qwen3_next",  # and with Qwen3.5's experts
    "qwen3_vl_text": "qwen3",  # Qwen3-VL's text model: Qwen3 with M-RoPE
    "glm4_moe": "deepseek_v3",  # GLM-4.5 routes as DeepSeek-V3 does (the same router and checks)
}

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
    # q_norm/k_norm normalize the whole projection (OLMo, OLMoE), not each head: heads * head_dim wide.
    whole_qk_norm: bool = False
    # The module's attention folds grouped query heads into an extra axis (Gemma 2), so a per-row mask needs
    # one more axis to broadcast there.
    folds_query_groups: bool = False
    # The module's attention cannot read a quantized KV cache (it soft-caps the scores itself, or multiplies a
    # cached latent): loading with kv_bits is refused.
    float_kv_only: bool = False
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
    # The family's own reading of its RoPE settings into mlx-lm's classic keys, instead of the common one:
    # `rope_args(args, source, spec)` returns the keys to set (Gemma 3: a separate base for sliding layers).
    rope_args: Callable[[dict[str, Any], str, ArchSpec], dict[str, Any]] | None = None
    # quantization_config.quant_method values whose checkpoints MLX runs as stored (gpt-oss's MXFP4 experts);
    # any other method is refused.
    native_quantization: frozenset[str] = frozenset()
    # transformers' class, written to a converted config.json's `architectures` when the source has none
    # (None: LlamaForCausalLM).
    hf_class: str | None = None
    # `mlx_lm_form(config)`: the keys a converted config.json must hold for mlx-lm's `load()`, where it would
    # misread this family's source form (mlxinfer reads them too). None: nothing to rewrite.
    mlx_lm_form: Callable[[ModelConfig], dict[str, Any]] | None = None
    # `adapt(model, config)` makes mlx-lm's freshly built layers compute what transformers does (and may
    # replace `model.mlx_sanitize`): the family file's layer adapters, run when such a model is built.
    adapt: Callable[[DecoderLM, ModelConfig], None] | None = None
    # A fused linear layer of the checkpoint that the runtime splits by output rows into the modules named, in
    # order (paths after the layer's prefix): an adapter's pair on it splits the same way (adapters/loading.py).
    fused_outputs: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


# Flags the Gemma families share (their embeddings scaled by sqrt(hidden_size), tied heads, tanh GELU).
GEMMA = dict(
    activation_keys=("hidden_activation", "hidden_act"),
    activations=frozenset({"gelu_pytorch_tanh", "gelu_tanh"}),
    scales_embeddings=True,
    tied_by_default=True,
)


def family_module(model_type: str) -> str:
    """The module that holds `model_type`'s row, e.g. "mlxinfer.families.gpt_oss"."""
    return f"{FAMILIES_PACKAGE}.{SHARED_FILES.get(model_type, model_type)}"


class _Registry(Mapping[str, ArchSpec]):
    """model_type -> its ArchSpec, from the family file that holds it (imported on first use).

    The names come from the files in mlxinfer/families/ (and SHARED_FILES), so a membership test never imports
    a family, and an untrusted model_type is never used to name an import."""

    def __getitem__(self, model_type: str) -> ArchSpec:
        if model_type not in self:
            raise KeyError(model_type)
        return importlib.import_module(family_module(model_type)).SPECS[model_type]

    def __contains__(self, model_type: object) -> bool:
        return isinstance(model_type, str) and model_type in _model_types()

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(_model_types()))

    def __len__(self) -> int:
        return len(_model_types())


@cache
def _model_types() -> frozenset[str]:
    files = {m.name for m in pkgutil.iter_modules([str(_FAMILIES_FOLDER)]) if not m.name.startswith("_")}
    return frozenset(files | {t for t, file in SHARED_FILES.items() if file in files})


ARCHITECTURES: Mapping[str, ArchSpec] = _Registry()


def supported_model_types() -> list[str]:
    return sorted(ARCHITECTURES)
