"""Qwen3-MoE (Qwen3MoeForCausalLM): experts on the layers decoder_sparse_step and mlp_only_layers pick, and one
window every layer slides in or none. mlx-lm's blocks compute what transformers' do; only the checkpoint's
per-expert tensors need stacking into mlx-lm's switch_mlp (models/moe_weights.py)."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from ..models.config import MAX_LAYERS, ModelConfig
from ..models.config_rules import check_experts, expert_count, positive_int, require_bools
from ..models.decoder import DecoderLM
from ..models.gguf_arch import EXPERT_NAMES, GGUFArch, Meta
from ..models.moe_weights import QWEN, expert_sanitizer
from ..models.registry import ArchSpec
from ..untrusted import is_int, shown

# Qwen3MoeConfig's defaults for keys config.json may leave out and mlx-lm needs. The expert count is read under
# either name first (expert_count).
QWEN3_MOE_DEFAULTS: dict[str, Any] = {
    "intermediate_size": 6144, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "num_experts_per_tok": 8, "moe_intermediate_size": 768, "decoder_sparse_step": 1, "norm_topk_prob": False,
    "sliding_window": 4096,
}  # fmt: skip


def check_qwen3_moe(args: dict[str, Any], source: str) -> None:
    """Experts (0: every layer dense), which layers have them, and the window every layer slides in or none."""
    if check_experts(args, source, expert_count(args, source, "num_experts", "num_local_experts", 128), True):
        positive_int(args, "moe_intermediate_size", source)
        positive_int(args, "decoder_sparse_step", source, MAX_LAYERS)
        require_bools(args, source, ("norm_topk_prob",))
    if args.get("mlp_only_layers") is None:  # transformers reads null as "none"
        args["mlp_only_layers"] = []
    only = args["mlp_only_layers"]
    if not isinstance(only, list) or len(only) > MAX_LAYERS or not all(is_int(i) for i in only):
        raise ConfigError(f"{source}: mlp_only_layers must be a list of layer indices, got {shown(only)}")
    # Qwen3MoeConfig keeps the window only with use_sliding_window, and then every layer slides
    # (max_window_layers is not read); the registry row derives layer_types from the window alone.
    if not args.get("use_sliding_window"):
        args["sliding_window"] = None


def adapt(model: DecoderLM, config: ModelConfig) -> None:
    expert_sanitizer(model, config, QWEN)


SPECS = {
    "qwen3_moe": ArchSpec(
        "qwen3_moe",
        sliding="all",  # check_qwen3_moe keeps the window only with use_sliding_window
        rope_types=frozenset({"default"}),  # mlx-lm's module builds a plain RoPE
        neutral={"attention_bias": False},
        renamed={"num_experts": "num_local_experts"},  # transformers 5 writes the second name, mlx-lm reads the first
        defaults=QWEN3_MOE_DEFAULTS,
        check_config=check_qwen3_moe,
        mlx_sanitize=True,
        adapt=adapt,
    ),
}


def gguf_config(meta: Meta) -> dict[str, Any]:
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


GGUF = {
    "qwen3moe": GGUFArch(
        "qwen3_moe",
        (1e-6, 1_000_000.0),
        gguf_config,
        names={"ffn_gate_inp": "mlp.gate", **{k: f"mlp.switch_mlp.{v}" for k, v in EXPERT_NAMES.items()}},
    ),
}
