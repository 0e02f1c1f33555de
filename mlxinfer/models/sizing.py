"""Size a model from its config and its checkpoint's tensor index before building it.

Building instantiates one module per layer and arrays of the config's sizes, so a
few bytes of config (`num_hidden_layers: 1000000`, a hidden size of 10^9) could
cost minutes and gigabytes before a missing tensor is noticed. Here, with only
the headers read: the config must fit this machine, its layer count must be the
checkpoint's, and each size must be the one the checkpoint's first tensors show.
The remaining tensors are checked after building (loader.verify_weights), which
is then bounded by the checkpoint itself.
"""

from __future__ import annotations

import re
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..display import mib
from ..errors import ConfigError, MemoryBudgetError, WeightMismatchError
from ..memory import machine_memory
from ..untrusted import is_int, plain, shown
from .config import ATTENTION, ModelConfig

# The fewest bits per weight any checkpoint we load stores (mlx 2-bit quantization):
# a config that does not fit even so cannot fit at all.
MIN_BITS_PER_WEIGHT = 2
_LAYER = re.compile(r"model\.layers\.(0|[1-9][0-9]{0,8})\.")
_L0 = "model.layers.0."
_ATTN = "model.layers.{attn}."  # the first attention layer (hybrid models may start with recurrent ones)
_GATED_Q = "2 * num_attention_heads * head_dim"
# Tensors that show each size, in the order they are consulted: (name, dimension).
_EVIDENCE: dict[str, tuple[tuple[str, int], ...]] = {
    "vocab_size": (("model.embed_tokens.weight", 0), ("lm_head.weight", 0)),
    "hidden_size": (("model.embed_tokens.weight", 1), ("model.norm.weight", 0), ("lm_head.weight", 1)),
    "num_attention_heads * head_dim": ((f"{_ATTN}self_attn.q_proj.weight", 0), (f"{_ATTN}self_attn.o_proj.weight", 1)),
    "num_key_value_heads * head_dim": ((f"{_ATTN}self_attn.k_proj.weight", 0), (f"{_ATTN}self_attn.v_proj.weight", 0)),
    "(num_attention_heads + 2 * num_key_value_heads) * head_dim": ((f"{_ATTN}self_attn.qkv_proj.weight", 0),),
    "head_dim": ((f"{_ATTN}self_attn.q_norm.weight", 0), (f"{_ATTN}self_attn.k_norm.weight", 0)),
    "intermediate_size": ((f"{_L0}mlp.gate_proj.weight", 0), (f"{_L0}mlp.up_proj.weight", 0)),
    "2 * intermediate_size": ((f"{_L0}mlp.gate_up_proj.weight", 0),),
}
# The router of the first MoE layer shows how many experts there are (its rows), in every family's names.
_ROUTERS = ("mlp.gate", "mlp.router", "block_sparse_moe.gate", "block_sparse_moe.router.layer")
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_SPARSE_RULES = (("decoder_sparse_step", 1), ("first_k_dense_replace", 0), ("moe_layer_freq", 1))
_REQUIRED = ("vocab_size", "hidden_size")  # every checkpoint has an embedding
_SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim")  # fmt: skip


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as its file's header describes it."""

    shape: tuple[int, ...]  # a packed quantized weight's last dimension is not its input size
    loaded_bytes: int  # what it takes in memory once loaded (floats in the compute dtype)
    packed: bool = False


def check_before_build(config: ModelConfig, tensors: Mapping[str, StoredTensor], source: str) -> None:
    """Refuse, from headers alone, a config this machine cannot hold or that does not describe `tensors`."""
    if not config.verified:  # mlx-lm's module reads its own keys: the tensors alone tell the size
        refuse_beyond_machine(sum(t.loaded_bytes for t in tensors.values()), "its weights", source)
        return
    params = parameter_count(config)
    moe = moe_layout(config, source)
    sizes = ", ".join(f"{k}={config.args[k]}" for k in _SIZE_FIELDS + ((moe.experts_key,) if moe else ()))
    what = f"the {params:,} parameters the config describes ({sizes}), even at {MIN_BITS_PER_WEIGHT} bits each,"
    refuse_beyond_machine(params * MIN_BITS_PER_WEIGHT // 8, what, source)
    packed = {name for name, t in tensors.items() if t.packed}
    check_checkpoint(config, {name: t.shape for name, t in tensors.items()}, source, packed)
    refuse_beyond_machine(sum(t.loaded_bytes for t in tensors.values()), "its weights", source)


def parameter_count(config: ModelConfig) -> int:
    """Weights of the embedding, head and every layer's projections, every expert of an MoE model included
    (norms and biases are noise)."""
    return _parameters(config, active=False)


def active_parameter_count(config: ModelConfig) -> int:
    """parameter_count with only the routed experts one token uses (num_experts_per_tok of each MoE layer)."""
    return _parameters(config, active=True)


def _parameters(config: ModelConfig, active: bool) -> int:
    a = config.args
    hidden, inner = config.hidden_size, int(a["intermediate_size"])
    q, kv = int(a["num_attention_heads"]) * int(a["head_dim"]), int(a["num_key_value_heads"]) * int(a["head_dim"])
    embeddings = config.vocab_size * hidden * (1 if config.tie_word_embeddings else 2)
    moe = moe_layout(config)
    if moe is None:
        return embeddings + config.num_layers * hidden * (2 * q + 2 * kv + 3 * inner)
    dense_layers = config.num_layers - len(moe.sparse_layers)
    mlps = dense_layers * 3 * hidden * inner + len(moe.sparse_layers) * moe.layer_parameters(hidden, active)
    return embeddings + config.num_layers * hidden * (2 * q + 2 * kv) + mlps


@dataclass(frozen=True)
class MoeLayout:
    """A mixture-of-experts model's experts as its config describes them (transformers' rules)."""

    experts: int  # routed experts in each MoE layer
    experts_key: str  # the config key that says so
    experts_per_token: int
    sparse_layers: tuple[int, ...]  # the layers with experts; the others have a dense MLP of intermediate_size
    expert_width: int  # one routed expert's intermediate size
    shared_width: int  # the shared experts' intermediate sizes of one MoE layer, together (0: none)

    def layer_parameters(self, hidden: int, active: bool = False) -> int:
        """One MoE layer's gated MLPs (3 matrices each) and router; `active`: only the experts one token uses."""
        return self.expert_parameters(hidden, active) + 3 * hidden * self.shared_width + self.experts * hidden

    def expert_parameters(self, hidden: int, active: bool = False) -> int:
        """One MoE layer's routed experts (gate, up and down each); `active`: only those one token uses."""
        return 3 * hidden * (self.experts_per_token if active else self.experts) * self.expert_width


def moe_layout(config: ModelConfig, source: str = "config.json") -> MoeLayout | None:
    """The experts of `config`, None for a dense model.

    Families name the same things differently: the expert count is num_experts (Qwen, OLMoE),
    num_local_experts (Mixtral, gpt-oss, Granite; transformers 5 writes it for Qwen3-MoE too) or
    n_routed_experts (DeepSeek, GLM-4.5); an expert's width is moe_intermediate_size where the model
    also has dense layers of intermediate_size, else intermediate_size itself.
    """
    a = config.args
    key = next((key for key in _EXPERT_COUNT_KEYS if a.get(key)), None)
    if key is None:
        return None
    experts = _count(a, key, 0, source)
    width = _count(a, "moe_intermediate_size", 0, source) or _count(a, "intermediate_size", 0, source)
    shared_key = next((k for k in ("shared_expert_intermediate_size", "shared_intermediate_size") if a.get(k)), None)
    shared = _count(a, shared_key, 0, source) if shared_key else _count(a, "n_shared_experts", 0, source) * width
    return MoeLayout(
        experts=experts,
        experts_key=key,
        # No num_experts_per_tok: count every expert as read, the conservative bound.
        experts_per_token=min(experts, _count(a, "num_experts_per_tok", experts, source)),
        sparse_layers=_sparse_layers(config, source),
        expert_width=width,
        shared_width=shared,
    )


def _sparse_layers(config: ModelConfig, source: str) -> tuple[int, ...]:
    # Qwen: not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0; DeepSeek/GLM: i >= first_k_dense_replace
    # and i % moe_layer_freq == 0. Each rule's defaults leave every layer sparse (Mixtral, gpt-oss, Granite).
    dense = config.args.get("mlp_only_layers") or []
    if not (isinstance(dense, list) and all(is_int(i) for i in dense)):
        raise ConfigError(f"{source}: mlp_only_layers must be a list of layer indices, got {shown(dense)}")
    step, first, freq = (_count(config.args, key, default, source) or default for key, default in _SPARSE_RULES)
    return tuple(
        i for i in range(config.num_layers) if i not in dense and (i + 1) % step == 0 and i >= first and i % freq == 0
    )


def _count(args: Mapping[str, Any], key: str, default: int, source: str) -> int:
    """A non-negative integer setting, `default` when absent or null."""
    value = args.get(key)
    if value is None:
        return default
    if not (is_int(value) and value >= 0):
        raise ConfigError(f"{source}: {key} must be a non-negative integer, got {shown(value)}")
    return int(value)


def refuse_beyond_machine(nbytes: int, what: str, source: str) -> None:
    """MemoryBudgetError unless `nbytes` fit the most this machine could ever give (every other app closed).

    The current moment (free memory, other models) is the planner's to judge at each request;
    only what can never fit is refused here."""
    machine = machine_memory()
    most = machine.usable_bytes(already_ours=machine.total_bytes - machine.available_bytes)
    if nbytes > most:
        raise MemoryBudgetError(
            f"{source}: {what} need {mib(nbytes, 0)} but this machine can hold at most {mib(most, 0)} "
            f"(its memory less {mib(machine.headroom_bytes, 0)} kept for the system); use a smaller or more "
            "quantized model"
        )


def check_checkpoint(
    config: ModelConfig, shapes: Mapping[str, Sequence[int]], source: str, packed: Container[str] = frozenset()
) -> None:
    """WeightMismatchError naming the field and the tensor where the config and the checkpoint disagree."""
    if not config.verified:  # unverified: the built module checks every tensor (loader.verify_weights)
        return
    sizes, evidence = _sizes(config), _evidence(config)
    for field in _REQUIRED:
        _check_size(field, sizes[field], evidence[field], shapes, packed, source)
    # GLM-4.5 and DeepSeek-V3 checkpoints store their multi-token-prediction layers after the decoder's.
    _check_layer_count(config.num_layers, shapes, source, int(config.args.get("num_nextn_predict_layers") or 0))
    for field in evidence:
        if field not in _REQUIRED:
            _check_size(field, sizes[field], evidence[field], shapes, packed, source)


def _evidence(config: ModelConfig) -> dict[str, tuple[tuple[str, int], ...]]:
    """_EVIDENCE with the attention tensors of the model's first attention layer (none without one); a q_proj
    that also computes each head's output gate (spec.gated_queries) shows twice the query width."""
    attn = next((i for i, kind in enumerate(config.layer_types) if kind in ATTENTION), None)
    if "kv_lora_rank" in config.args:  # latent attention (deepseek_v3): no q/k/v projections of heads * head_dim
        attn = None
    evidence = {
        field: tuple((name.format(attn=attn), dim) for name, dim in entries if attn is not None or _ATTN not in name)
        for field, entries in _EVIDENCE.items()
    }
    final_norm = f"model.{config.spec.final_norm}.weight"  # lfm2's is embedding_norm: with a packed, tied
    if final_norm not in dict(evidence["hidden_size"]):  # embedding it is the only tensor showing hidden_size
        evidence["hidden_size"] += ((final_norm, 0),)
    if config.spec.whole_qk_norm:  # OLMo's q/k norms span every head: they show the projections' widths
        for field, norm in zip(("num_attention_heads * head_dim", "num_key_value_heads * head_dim"),
                               evidence.pop("head_dim")):  # fmt: skip
            evidence[field] += (norm,)
    if config.spec.gated_queries:
        q_proj, o_proj = evidence["num_attention_heads * head_dim"]
        evidence["num_attention_heads * head_dim"], evidence[_GATED_Q] = (o_proj,), (q_proj,)
    moe = moe_layout(config)
    if moe is not None and moe.sparse_layers:
        first = moe.sparse_layers[0]
        evidence[moe.experts_key] = tuple((f"model.layers.{first}.{router}.weight", 0) for router in _ROUTERS)
    return evidence


def _sizes(config: ModelConfig) -> dict[str, tuple[int, str]]:
    """Each checked size, with the config values it comes from when it is a product."""
    a = config.args
    heads, kv_heads, head_dim = int(a["num_attention_heads"]), int(a["num_key_value_heads"]), int(a["head_dim"])
    inner = int(a["intermediate_size"])
    # head_dim may be derived (hidden_size / num_attention_heads): name all three.
    attention = f" (num_attention_heads={heads}, num_key_value_heads={kv_heads}, head_dim={head_dim})"
    sizes = {
        "vocab_size": (config.vocab_size, ""),
        "hidden_size": (config.hidden_size, ""),
        "num_attention_heads * head_dim": (heads * head_dim, attention),
        "num_key_value_heads * head_dim": (kv_heads * head_dim, attention),
        "(num_attention_heads + 2 * num_key_value_heads) * head_dim": ((heads + 2 * kv_heads) * head_dim, attention),
        _GATED_Q: (2 * heads * head_dim, attention),
        "head_dim": (head_dim, attention),
        "intermediate_size": (inner, ""),
        "2 * intermediate_size": (2 * inner, ""),
    }
    if moe := moe_layout(config):
        sizes[moe.experts_key] = (moe.experts, "")
    return sizes


def _check_size(
    field: str,
    size: tuple[int, str],
    evidence: tuple[tuple[str, int], ...],
    shapes: Mapping[str, Sequence[int]],
    packed: Container[str],
    source: str,
) -> None:
    value, detail = size
    for name, dim in evidence:
        shape = shapes.get(name)
        if shape is None or (name in packed and dim == len(shape) - 1):
            continue  # absent, or a packed dimension that holds bits rather than inputs
        if dim >= len(shape) or shape[dim] != value:
            raise WeightMismatchError(
                f"{source}: {field} is {value}{detail} but {name} has shape {tuple(shape)} (dimension {dim} should "
                f"be {value}); the config does not describe these weights"
            )
        return
    if field in _REQUIRED:
        names = " or ".join(name for name, _ in evidence)
        raise WeightMismatchError(f"{source}: no tensor shows {field} (expected {names}); the checkpoint is incomplete")


def _check_layer_count(layers: int, shapes: Mapping[str, Sequence[int]], source: str, extra: int = 0) -> None:
    found = {int(m.group(1)) for name in shapes if (m := _LAYER.match(name))}
    if any(len(found) == n and max(found) == n - 1 for n in {layers, layers + extra}):
        return  # distinct non-negative indices: exactly 0 .. layers-1 (and the `extra` after them, if stored)
    held = f"layers {min(found)} to {max(found)} ({len(found)} in all)" if found else "no model.layers.* tensors"
    example = next((plain(n) for n in sorted(shapes) if _LAYER.match(n)), "")
    raise WeightMismatchError(
        f"{source}: num_hidden_layers is {layers} but the checkpoint has {held}"
        + (f", e.g. {example}" if example else "")
        + "; the config does not describe these weights"
    )
