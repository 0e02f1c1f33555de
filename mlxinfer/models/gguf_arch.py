"""llama.cpp's per-architecture GGUF conventions, read back into Hugging Face form.

For each `general.architecture`: which metadata keys give which config.json keys, which tensor
names give which Hugging Face names, and what llama.cpp's converter (convert_hf_to_gguf.py) did to
the values: Q/K rows permuted (llama only), Gemma's RMSNorm weights stored as 1 + w.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError, UnsupportedModelError
from ..formats.safetensors_header import MAX_DIM
from ..untrusted import is_finite_number, is_int, shown
from .config import MAX_LAYERS
from .registry import ARCHITECTURES as FAMILIES

FULL, SLIDING = "full_attention", "sliding_attention"
_REQUIRED: Any = object()

# llama.cpp block tensor -> Hugging Face module, shared by every architecture (each may override).
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Parameters that are bare arrays, not a module's `.weight` (gpt-oss's attention sinks).
BARE = frozenset({"self_attn.sinks"})


@dataclass(frozen=True)
class GGUFArch:
    model_type: str
    extra: Callable[[Meta], dict[str, Any]]  # the architecture's own config keys
    names: dict[str, str] = field(default_factory=dict)  # overrides of LAYER_NAMES
    permutes_qk: bool = False  # llama.cpp's `permute` on Q/K rows (LlamaModel only)
    norm_shift: float = 0.0  # stored norm weight = HF weight + norm_shift (Gemma3Model.norm_shift)


class Meta:
    """Typed reads of one architecture's `{arch}.*` metadata keys, each error naming the key and file."""

    REQUIRED = _REQUIRED

    def __init__(self, path: Path, md: dict[str, Any], arch: str, tensors: dict[str, Any]):
        self.path, self.md, self.arch, self.tensors = path, md, arch, tensors

    def int(self, key: str, default: Any = _REQUIRED, low: int = 1, high: int = MAX_DIM, prefix: bool = True) -> Any:
        name = f"{self.arch}.{key}" if prefix else key
        value = self.md.get(name)
        if value is None:
            if default is _REQUIRED:
                raise ConfigError(f"{self.path}: GGUF metadata lacks {name!r}; the file is incomplete")
            return default
        if not is_int(value) or not low <= value <= high:
            raise ConfigError(
                f"{self.path}: GGUF metadata {name!r} must be an integer from {low} to {high}, got {shown(value)}"
            )
        return int(value)  # a plain int, should a reader hand in a numpy scalar

    def float(self, key: str, default: Any) -> Any:
        """A positive, finite number (every float we read is a base, an epsilon, a factor or a cap)."""
        name = f"{self.arch}.{key}"
        value = self.md.get(name)
        if value is None:
            return default
        if not is_finite_number(value) or value <= 0:
            raise ConfigError(
                f"{self.path}: GGUF metadata {name!r} must be a positive finite number, got {shown(value)}"
            )
        return float(value)

    def str(self, key: str) -> str | None:
        value = self.md.get(f"{self.arch}.{key}")
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"{self.path}: GGUF metadata '{self.arch}.{key}' must be a string, got {shown(value)}")
        return value


def common_config(meta: Meta, eps: float, theta: float) -> dict[str, Any]:
    """The keys every decoder has (LLM_KV_* names shared by all architectures)."""
    hidden = meta.int("embedding_length")
    heads = meta.int("attention.head_count")
    return {
        "hidden_size": hidden,
        "intermediate_size": meta.int("feed_forward_length"),
        "num_hidden_layers": meta.int("block_count", high=MAX_LAYERS),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.int("attention.head_count_kv", heads),
        # key_length is the head size wherever the converter writes it (Gemma, Qwen3, gpt-oss).
        "head_dim": meta.int("attention.key_length", hidden // heads),
        "rms_norm_eps": meta.float("attention.layer_norm_rms_epsilon", eps),
        "rope_theta": meta.float("rope.freq_base", theta),
        "max_position_embeddings": meta.int("context_length", 4096),
    }


def _llama(meta: Meta) -> dict[str, Any]:
    heads, hidden = meta.int("attention.head_count"), meta.int("embedding_length")
    out: dict[str, Any] = {"head_dim": meta.int("rope.dimension_count", hidden // heads)}
    # Llama's biases are switched on by config flags, which GGUF has no key for: the tensors tell.
    out["attention_bias"] = "blk.0.attn_q.bias" in meta.tensors
    out["mlp_bias"] = "blk.0.ffn_down.bias" in meta.tensors
    window = meta.int("attention.sliding_window", None)
    if window is not None:  # a Mistral that keeps its window: transformers' mistral applies it, llama would not
        out.update(model_type="mistral", sliding_window=window)
    return out


def _qwen(meta: Meta) -> dict[str, Any]:
    return {}


def _phi3(meta: Meta) -> dict[str, Any]:
    if "rope_factors_long.weight" in meta.tensors or "rope_factors_short.weight" in meta.tensors:
        raise UnsupportedModelError(
            f"{meta.path}: this phi3 GGUF stores LongRoPE factors (rope_factors_long/short), which are not "
            "supported; use a 4k-context Phi-3 or the model's Hugging Face checkpoint"
        )
    hidden, heads = meta.int("embedding_length"), meta.int("attention.head_count")
    head_dim = hidden // heads
    rotary = meta.int("rope.dimension_count", head_dim)  # int(partial_rotary_factor * head_dim)
    out: dict[str, Any] = {"head_dim": head_dim, "partial_rotary_factor": rotary / head_dim}
    # Phi3MiniModel writes 0 for "no window" (Phi-4 and configs with sliding_window null).
    out["sliding_window"] = meta.int("attention.sliding_window", 0, low=0) or None
    original = meta.int("rope.scaling.original_context_length", None)
    if original is not None:
        out["original_max_position_embeddings"] = original
    return out


def _gemma3(meta: Meta) -> dict[str, Any]:
    layers, head_dim = meta.int("block_count", high=MAX_LAYERS), meta.int("attention.key_length", 256)
    hidden, heads = meta.int("embedding_length"), meta.int("attention.head_count")
    window = meta.int("attention.sliding_window", None)
    # llama.cpp fixes every 6th layer global (set_swa_pattern(6)) unless the file says otherwise.
    every = meta.int("attention.sliding_window_pattern", 6, high=MAX_LAYERS)
    types = [SLIDING if window is not None and (i + 1) % every else FULL for i in range(layers)]
    out: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": types,
        "sliding_window": window,
        # llama.cpp's f_attention_scale: 1/sqrt(head_dim), but hidden/heads for the 62-layer 27B model.
        "query_pre_attn_scalar": hidden // heads if layers == 62 else head_dim,
        # llama.cpp hard-codes 10000 for the sliding layers; newer files write it.
        "rope_local_base_freq": meta.float("rope.freq_base_swa", 10_000.0),
        "final_logit_softcapping": meta.float("final_logit_softcapping", None),
        "attn_logit_softcapping": meta.float("attn_logit_softcapping", None),
    }
    return out


def _gpt_oss(meta: Meta) -> dict[str, Any]:
    experts = meta.int("expert_count")
    out: dict[str, Any] = {
        "num_local_experts": experts,
        "num_experts_per_tok": meta.int("expert_used_count", high=experts),
        "intermediate_size": meta.int("expert_feed_forward_length"),
        "sliding_window": meta.int("attention.sliding_window", 128),
        "attention_bias": True,
    }
    kind = meta.str("rope.scaling.type")
    if kind == "yarn":
        # gpt-oss's own config has truncate: false and betas 32/1; llama.cpp writes neither.
        out["rope_scaling"] = {
            "rope_type": "yarn",
            "factor": meta.float("rope.scaling.factor", 32.0),
            "original_max_position_embeddings": meta.int("rope.scaling.original_context_length", 4096),
            "beta_fast": meta.float("rope.scaling.yarn_beta_fast", 32.0),
            "beta_slow": meta.float("rope.scaling.yarn_beta_slow", 1.0),
            "truncate": False,
        }
    elif kind not in (None, "none"):
        raise UnsupportedModelError(f"{meta.path}: gpt-oss GGUF rope.scaling.type={shown(kind)} is not supported")
    return out


def _qwen3_moe(meta: Meta) -> dict[str, Any]:
    experts, layers = meta.int("expert_count"), meta.int("block_count", high=MAX_LAYERS)
    norm = meta.md.get(f"{meta.arch}.expert_weights_norm", True)  # llama.cpp's qwen3moe graph always normalizes
    return {
        "num_experts": experts,
        "num_experts_per_tok": meta.int("expert_used_count", high=experts),
        "moe_intermediate_size": meta.int("expert_feed_forward_length"),
        "norm_topk_prob": bool(norm),
        "decoder_sparse_step": 1,
        # Layers without a router are dense (Qwen3MoeConfig.mlp_only_layers); their width is feed_forward_length.
        "mlp_only_layers": [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in meta.tensors],
    }


_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
ARCHITECTURES: dict[str, GGUFArch] = {
    "llama": GGUFArch("llama", _llama, permutes_qk=True),
    "qwen2": GGUFArch("qwen2", _qwen),
    "qwen3": GGUFArch("qwen3", _qwen),
    "qwen3moe": GGUFArch(
        "qwen3_moe",
        _qwen3_moe,
        names={"ffn_gate_inp": "mlp.gate", **{k: f"mlp.switch_mlp.{v}" for k, v in _EXPERTS.items()}},
    ),
    "phi3": GGUFArch("phi3", _phi3, names={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}),
    "gemma3": GGUFArch(
        "gemma3_text",
        _gemma3,
        names={
            "ffn_norm": "pre_feedforward_layernorm",
            "post_attention_norm": "post_attention_layernorm",
            "post_ffw_norm": "post_feedforward_layernorm",
        },  # fmt: skip
        norm_shift=1.0,
    ),
    "gpt-oss": GGUFArch(
        "gpt_oss",
        _gpt_oss,
        names={
            "post_attention_norm": "post_attention_layernorm",
            "attn_sinks": "self_attn.sinks",
            "ffn_gate_inp": "mlp.router",
            **{k: f"mlp.experts.{v}" for k, v in _EXPERTS.items()},
        },  # fmt: skip
    ),
}
DEFAULTS = {  # transformers' config defaults where llama.cpp may leave a key out
    "llama": (1e-5, 10_000.0),
    "qwen2": (1e-6, 1_000_000.0),
    "qwen3": (1e-6, 1_000_000.0),
    "qwen3moe": (1e-6, 1_000_000.0),
    "phi3": (1e-5, 10_000.0),
    "gemma3": (1e-6, 1_000_000.0),
    "gpt-oss": (1e-5, 150_000.0),
}


def supported_architectures() -> list[str]:
    """GGUF architectures we read whose Hugging Face family is registered (qwen3moe needs qwen3_moe)."""
    return sorted(a for a, spec in ARCHITECTURES.items() if spec.model_type in FAMILIES)


def architecture(path: Path, md: dict[str, Any]) -> tuple[str, GGUFArch]:
    """`general.architecture` and its conventions; an architecture we cannot map is refused."""
    arch = md.get("general.architecture")
    if not isinstance(arch, str) or arch not in supported_architectures():
        raise UnsupportedModelError(
            f"{path}: GGUF general.architecture={shown(arch)} is not supported; "
            f"supported: {', '.join(supported_architectures())}"
        )
    return arch, ARCHITECTURES[arch]


def layer_name(arch: GGUFArch, stem: str) -> str | None:
    return arch.names.get(stem, LAYER_NAMES.get(stem))
