"""DeepSeek-V3 (deepseek_v3; also Kimi-K2, Moonlight) and GLM-4.5 (glm4_moe): grouped sigmoid routing, and
DeepSeek's Multi-head Latent Attention (MLA). One file for both: GLM-4.5 routes exactly as DeepSeek-V3 does.

Both route like DeepSeek-V3: sigmoid scores plus `e_score_correction_bias` pick `topk_group` of `n_group`
expert groups, then the top `num_experts_per_tok` experts inside them, weighted by their plain sigmoid
scores (renormalized with norm_topk_prob) times routed_scaling_factor; a shared expert always runs.
What mlx-lm's modules do differently from transformers' Glm4MoeForCausalLM and DeepseekV3ForCausalLM:
- Routing (both): transformers drops the groups it does not keep with -inf and renormalizes even a single
  expert's weight; mlx-lm sets them to 0 (a kept expert whose biased score is negative then loses to a
  dropped one) and skips the renormalization for top-1.
- RoPE (deepseek_v3): transformers' YaRN frequencies and cos/sin factor (models/yarn.py; mlx-lm always
  rounds the correction range and reads the factor its own way), and `rope_interleave: false` (half-split
  pairs), which mlx-lm's MLA ignores. The softmax scale with YaRN's mscale_all_dim is mlx-lm's, as transformers.
- Multi-token-prediction layers stored after the decoder's own (model.layers.{num_hidden_layers}...) are
  dropped, as transformers ignores them.
References: transformers' configuration_glm4_moe.py / configuration_deepseek_v3.py and their modeling files.
"""

from __future__ import annotations

import re
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..errors import ConfigError, WeightMismatchError
from ..formats.safetensors_header import MAX_DIM
from ..models.config import ModelConfig
from ..models.config_rules import MAX_EXPERTS, positive_int, require_bools
from ..models.decoder import DecoderLM
from ..models.registry import ArchSpec
from ..models.yarn import yarn_inverse_frequencies
from ..untrusted import is_finite_number, is_int, listed, shown

MAX_MTP_LAYERS = 16  # multi-token-prediction layers stored after the decoder's own (1 in real checkpoints)

# transformers' defaults (Glm4MoeConfig; partial_rotary_factor is its __post_init__ default) for keys
# config.json may leave out, where mlx-lm has none or another.
GLM4_MOE_DEFAULTS: dict[str, Any] = {
    "intermediate_size": 10944, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 10_000.0,
    "attention_bias": False, "use_qk_norm": False, "partial_rotary_factor": 0.5,
    "moe_intermediate_size": 1408, "num_experts_per_tok": 8, "n_shared_experts": 1, "n_routed_experts": 128,
    "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "norm_topk_prob": True,
}  # fmt: skip
# DeepseekV3Config's; mlx-lm's differ for most MoE keys (no shared expert, scaling 1.0, one group, top-1).
DEEPSEEK_V3_DEFAULTS: dict[str, Any] = {
    "intermediate_size": 18432, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10_000.0,
    "attention_bias": False, "rope_interleave": True,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
    "moe_intermediate_size": 2048, "num_experts_per_tok": 8, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3, "norm_topk_prob": True,
}  # fmt: skip


def check_glm4_moe(args: dict[str, Any], source: str) -> None:
    """GLM-4.5: the routing sizes and the attention switches."""
    _check_routing(args, source)
    require_bools(args, source, ("attention_bias", "use_qk_norm"))


def check_deepseek_v3(args: dict[str, Any], source: str) -> None:
    """DeepSeek-V3 (also Kimi-K2, Moonlight): the routing and the Multi-head Latent Attention sizes."""
    _check_routing(args, source)
    require_bools(args, source, ("attention_bias", "rope_interleave"))
    if args["q_lora_rank"] is not None:  # null: queries come from one q_proj (Moonlight)
        positive_int(args, "q_lora_rank", source)
    for key in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
        positive_int(args, key, source)
    if args["qk_rope_head_dim"] % 2:
        raise ConfigError(f"{source}: qk_rope_head_dim={args['qk_rope_head_dim']} must be even (RoPE turns pairs)")
    heads = args["num_attention_heads"]
    if heads * (args["qk_nope_head_dim"] + max(args["qk_rope_head_dim"], args["v_head_dim"])) > MAX_DIM:
        raise ConfigError(f"{source}: the attention projections are wider than {MAX_DIM}, the largest MLX dimension")
    # The keys and values MLA expands from its latent have one head per query head; transformers' attention
    # fails for any other num_key_value_heads.
    if args["num_key_value_heads"] != heads:
        raise ConfigError(
            f"{source}: num_key_value_heads={shown(args['num_key_value_heads'])} must equal "
            f"num_attention_heads={heads} for deepseek_v3 (latent attention expands one key head per query head)"
        )
    args["head_dim"] = args["qk_rope_head_dim"]  # as DeepseekV3Config: the rotated width


def _check_routing(args: dict[str, Any], source: str) -> None:
    experts = positive_int(args, "n_routed_experts", source, MAX_EXPERTS)
    top = positive_int(args, "num_experts_per_tok", source, experts)
    groups = positive_int(args, "n_group", source, experts)
    kept = positive_int(args, "topk_group", source, groups)
    # Each group is scored by its two best experts, so a group needs two.
    if experts % groups or experts // groups < 2:
        raise ConfigError(
            f"{source}: n_routed_experts={experts} must split into n_group={groups} equal groups of at least 2 experts"
        )
    if top > kept * (experts // groups):
        raise ConfigError(
            f"{source}: num_experts_per_tok={top} is more than the {kept * (experts // groups)} experts in the "
            f"topk_group={kept} groups the router keeps"
        )
    positive_int(args, "moe_intermediate_size", source)
    positive_int(args, "n_shared_experts", source, MAX_DIM // args["moe_intermediate_size"])
    dense = args["first_k_dense_replace"]
    if not (is_int(dense) and 0 <= dense <= args["num_hidden_layers"]):
        raise ConfigError(
            f"{source}: first_k_dense_replace must be an integer from 0 to num_hidden_layers="
            f"{args['num_hidden_layers']}, got {shown(dense)}"
        )
    scale = args["routed_scaling_factor"]
    if not (is_finite_number(scale) and scale > 0):
        raise ConfigError(f"{source}: routed_scaling_factor must be a positive finite number, got {shown(scale)}")
    require_bools(args, source, ("norm_topk_prob",))
    mtp = args.get("num_nextn_predict_layers") or 0
    if not (is_int(mtp) and 0 <= mtp <= MAX_MTP_LAYERS):
        raise ConfigError(
            f"{source}: num_nextn_predict_layers must be an integer from 0 to {MAX_MTP_LAYERS}, got {shown(mtp)}"
        )


# ---- Layers ----


_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+\.(?:weight|scales|biases))$")


def adapt(model: DecoderLM, config: ModelConfig) -> None:
    args = config.args
    for layer in model.layers:
        if hasattr(layer.mlp, "gate"):  # a MoE layer (the first first_k_dense_replace are dense)
            layer.mlp.gate = GroupedTopkRouter(
                args["n_routed_experts"], config.hidden_size, args["num_experts_per_tok"], args["n_group"],
                args["topk_group"], args["norm_topk_prob"], args["routed_scaling_factor"],
            )  # fmt: skip
        if config.model_type == "deepseek_v3":
            scaling = args.get("rope_scaling")  # None or "yarn": what config.py lets through
            layer.self_attn.rope = PairRoPE(
                args["qk_rope_head_dim"], args["rope_theta"], args["rope_interleave"], scaling
            )
    model.mlx_sanitize = _checked_sanitize(model.mlx_sanitize, config.num_layers, args["n_routed_experts"])


class GroupedTopkRouter(nn.Module):
    """transformers' DeepseekV3TopkRouter: the chosen experts (..., top_k) and their weights (float32)."""

    def __init__(self, experts: int, hidden: int, top_k: int, groups: int, kept_groups: int, renormalize: bool,
                 scaling: float):  # fmt: skip
        super().__init__()
        self.weight = mx.zeros((experts, hidden))
        self.e_score_correction_bias = mx.zeros((experts,))
        self._top_k, self._groups, self._kept, self._renormalize, self._scaling = (
            top_k, groups, kept_groups, renormalize, scaling
        )  # fmt: skip

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        scores = mx.sigmoid(x.astype(mx.float32) @ self.weight.astype(mx.float32).T)  # (..., experts)
        # The bias only chooses; the weights are the unbiased scores.
        choice = scores + self.e_score_correction_bias.astype(mx.float32)
        if self._kept < self._groups:
            grouped = mx.unflatten(choice, -1, (self._groups, -1))  # (..., groups, experts per group)
            group_scores = mx.topk(grouped, 2, axis=-1).sum(axis=-1, keepdims=True)  # (..., groups, 1)
            dropped = self._groups - self._kept
            worst = mx.argpartition(group_scores, kth=dropped - 1, axis=-2)[..., :dropped, :]
            grouped = mx.put_along_axis(grouped, worst, mx.array(-mx.inf, mx.float32), axis=-2)
            choice = mx.flatten(grouped, -2, -1)
        chosen = mx.argpartition(-choice, kth=self._top_k - 1, axis=-1)[..., : self._top_k]
        weights = mx.take_along_axis(scores, chosen, axis=-1)
        if self._renormalize:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
        return chosen, weights * self._scaling


class PairRoPE(nn.Module):
    """RoPE over all `dims` of its input: interleaved pairs (traditional) or half-split ones, with
    transformers' YaRN frequencies and cos/sin factor when `yarn` is given."""

    def __init__(self, dims: int, base: float, interleaved: bool, yarn: dict | None):
        super().__init__()
        self.dims, self.interleaved, self.base = dims, interleaved, base
        self.scale, self._freqs = 1.0, None
        if yarn is not None:
            inverse, self.scale = yarn_inverse_frequencies(dims, base, yarn)
            self.base, self._freqs = None, 1 / mx.array(inverse, dtype=mx.float32)  # mx.fast.rope takes periods

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        if self.scale != 1.0:  # scaling cos and sin scales the rotated vector
            x = x * self.scale
        return mx.fast.rope(
            x, self.dims, traditional=self.interleaved, base=self.base, scale=1.0, offset=offset, freqs=self._freqs
        )


def _checked_sanitize(sanitize, layers: int, experts: int):
    """mlx-lm's `sanitize` (it stacks the per-expert tensors), after dropping the tensors of layers past the
    decoder's `layers` (MTP modules) and refusing a stack with an expert missing (mlx-lm: a bare KeyError)."""

    def kept(name: str) -> bool:
        match = _LAYER.match(name)
        return match is None or int(match.group(1)) < layers

    def run(weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = {k: v for k, v in weights.items() if kept(k)}
        stacks = {match.group(1, 3) for name in weights if (match := _EXPERT.match(name))}
        missing = sorted(
            f"{stem}.{e}.{leaf}" for stem, leaf in stacks for e in range(experts) if f"{stem}.{e}.{leaf}" not in weights
        )
        if missing:
            raise WeightMismatchError(
                f"weights do not match the architecture; missing ({len(missing)}): {listed(missing)}"
            )
        return sanitize(weights)

    return run


# Keys transformers' GLM-4.5 / DeepSeek-V3 never read: they always route this way (mlx-lm asserts the method).
_DEEPSEEK_ROUTING = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}
SPECS = {
    "glm4_moe": ArchSpec(
        "glm4_moe",
        rope_types=frozenset({"default"}),  # mlx-lm's GLM-4.5 attention ignores rope scaling
        partial_rotary=True,
        neutral=_DEEPSEEK_ROUTING,
        defaults=GLM4_MOE_DEFAULTS,
        check_config=check_glm4_moe,
        mlx_sanitize=True,
        adapt=adapt,
    ),
    # Multi-head Latent Attention: the cache holds each position's normed latent and rotated key (one "head").
    "deepseek_v3": ArchSpec(
        "deepseek_v3",
        rope_types=frozenset({"default", "yarn"}),
        neutral={**_DEEPSEEK_ROUTING, "moe_layer_freq": 1},  # transformers makes every layer past the dense ones MoE
        float_kv_only=True,  # mlx-lm's MLA multiplies the cached latent itself, float only
        defaults=DEEPSEEK_V3_DEFAULTS,
        check_config=check_deepseek_v3,
        mlx_sanitize=True,
        adapt=adapt,
    ),
}
