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

from ..display import mib
from ..errors import MemoryBudgetError, WeightMismatchError
from ..memory import machine_memory
from ..untrusted import plain
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
    params = parameter_count(config)
    sizes = ", ".join(f"{k}={config.args[k]}" for k in _SIZE_FIELDS)
    what = f"the {params:,} parameters the config describes ({sizes}), even at {MIN_BITS_PER_WEIGHT} bits each,"
    refuse_beyond_machine(params * MIN_BITS_PER_WEIGHT // 8, what, source)
    packed = {name for name, t in tensors.items() if t.packed}
    check_checkpoint(config, {name: t.shape for name, t in tensors.items()}, source, packed)
    refuse_beyond_machine(sum(t.loaded_bytes for t in tensors.values()), "its weights", source)


def parameter_count(config: ModelConfig) -> int:
    """Weights of the embedding, head and every layer's projections (norms and biases are noise)."""
    a = config.args
    hidden, inner = config.hidden_size, int(a["intermediate_size"])
    q, kv = int(a["num_attention_heads"]) * int(a["head_dim"]), int(a["num_key_value_heads"]) * int(a["head_dim"])
    embeddings = config.vocab_size * hidden * (1 if config.tie_word_embeddings else 2)
    return embeddings + config.num_layers * hidden * (2 * q + 2 * kv + 3 * inner)


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
    sizes, evidence = _sizes(config), _evidence(config)
    for field in _REQUIRED:
        _check_size(field, sizes[field], evidence[field], shapes, packed, source)
    _check_layer_count(config.num_layers, shapes, source)
    for field in evidence:
        if field not in _REQUIRED:
            _check_size(field, sizes[field], evidence[field], shapes, packed, source)


def _evidence(config: ModelConfig) -> dict[str, tuple[tuple[str, int], ...]]:
    """_EVIDENCE with the attention tensors of the model's first attention layer (none without one); a q_proj
    that also computes each head's output gate (spec.gated_queries) shows twice the query width."""
    attn = next((i for i, kind in enumerate(config.layer_types) if kind in ATTENTION), None)
    evidence = {
        field: tuple((name.format(attn=attn), dim) for name, dim in entries if attn is not None or _ATTN not in name)
        for field, entries in _EVIDENCE.items()
    }
    final_norm = f"model.{config.spec.final_norm}.weight"  # lfm2's is embedding_norm: with a packed, tied
    if final_norm not in dict(evidence["hidden_size"]):  # embedding it is the only tensor showing hidden_size
        evidence["hidden_size"] += ((final_norm, 0),)
    if config.spec.gated_queries:
        q_proj, o_proj = evidence["num_attention_heads * head_dim"]
        evidence["num_attention_heads * head_dim"], evidence[_GATED_Q] = (o_proj,), (q_proj,)
    return evidence


def _sizes(config: ModelConfig) -> dict[str, tuple[int, str]]:
    """Each checked size, with the config values it comes from when it is a product."""
    a = config.args
    heads, kv_heads, head_dim = int(a["num_attention_heads"]), int(a["num_key_value_heads"]), int(a["head_dim"])
    inner = int(a["intermediate_size"])
    # head_dim may be derived (hidden_size / num_attention_heads): name all three.
    attention = f" (num_attention_heads={heads}, num_key_value_heads={kv_heads}, head_dim={head_dim})"
    return {
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


def _check_layer_count(layers: int, shapes: Mapping[str, Sequence[int]], source: str) -> None:
    found = {int(m.group(1)) for name in shapes if (m := _LAYER.match(name))}
    if len(found) == layers and max(found) == layers - 1:
        return  # distinct non-negative indices: exactly 0 .. layers-1
    held = f"layers {min(found)} to {max(found)} ({len(found)} in all)" if found else "no model.layers.* tensors"
    example = next((plain(n) for n in sorted(shapes) if _LAYER.match(n)), "")
    raise WeightMismatchError(
        f"{source}: num_hidden_layers is {layers} but the checkpoint has {held}"
        + (f", e.g. {example}" if example else "")
        + "; the config does not describe these weights"
    )
