"""llama.cpp's GGUF conventions, read back into Hugging Face form: what every architecture shares, and where
each architecture's own are (its family file in mlxinfer/families/, the `GGUF` table there).

For each `general.architecture`: which metadata keys give which config.json keys, which tensor
names give which Hugging Face names, and what llama.cpp's converter (convert_hf_to_gguf.py) did to
the values: Q/K rows permuted (llama only), Gemma's RMSNorm weights stored as 1 + w.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError, UnsupportedModelError
from ..formats.safetensors_header import MAX_DIM
from ..untrusted import is_finite_number, is_int, shown
from .config import MAX_LAYERS
from .registry import ARCHITECTURES as FAMILIES
from .registry import family_module

_REQUIRED: Any = object()
# GGUF `general.architecture` -> the model_type whose family file holds its conventions (in its `GGUF` table).
GGUF_FAMILIES = {
    "llama": "llama",  # also Mistral: llama.cpp writes it as llama (families/llama.py reads it back)
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3_moe",
    "phi3": "phi3",
    "gemma3": "gemma3_text",
    "gpt-oss": "gpt_oss",
}

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
# llama.cpp's stacked expert tensors -> the projection names of mlx-lm's SwitchGLU (under each family's block).
EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}


def no_extra_keys(meta: Meta) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class GGUFArch:
    model_type: str
    # transformers' rms_norm_eps and rope_theta, where llama.cpp may leave the key out.
    defaults: tuple[float, float]
    extra: Callable[[Meta], dict[str, Any]] = no_extra_keys  # the architecture's own config keys
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


class _Conventions(Mapping[str, GGUFArch]):
    """GGUF architecture name -> its conventions, from the family file that holds them (imported on first use)."""

    def __getitem__(self, arch: str) -> GGUFArch:
        if arch not in self:
            raise KeyError(arch)
        return importlib.import_module(family_module(GGUF_FAMILIES[arch])).GGUF[arch]

    def __contains__(self, arch: object) -> bool:
        return isinstance(arch, str) and arch in GGUF_FAMILIES

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(GGUF_FAMILIES))

    def __len__(self) -> int:
        return len(GGUF_FAMILIES)


ARCHITECTURES: Mapping[str, GGUFArch] = _Conventions()


# Model types llama.cpp writes under another family's architecture name (families/llama.py reads Mistral back).
WRITTEN_AS = {"mistral": "llama"}
_BY_MODEL_TYPE = {**{model_type: arch for arch, model_type in GGUF_FAMILIES.items()}, **WRITTEN_AS}


def conventions_of(model_type: str) -> GGUFArch:
    """The conventions a GGUF file of `model_type` was written with (Mistral's are llama's)."""
    return ARCHITECTURES[_BY_MODEL_TYPE[model_type]]


def supported_architectures() -> list[str]:
    """GGUF architectures we read whose Hugging Face family is registered (qwen3moe needs qwen3_moe)."""
    return sorted(a for a, model_type in GGUF_FAMILIES.items() if model_type in FAMILIES)


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
