"""GLM-4.5 and DeepSeek-V3 on mlx-lm's layers, made to compute what transformers' Glm4MoeForCausalLM and
DeepseekV3ForCausalLM do.

- Routing (both): transformers drops the groups it does not keep with -inf and renormalizes even a single
  expert's weight; mlx-lm sets them to 0 (a kept expert whose biased score is negative then loses to a
  dropped one) and skips the renormalization for top-1.
- RoPE (deepseek_v3): transformers' YaRN frequencies and cos/sin factor (models/yarn.py; mlx-lm always
  rounds the correction range and reads the factor its own way), and `rope_interleave: false` (half-split
  pairs), which mlx-lm's MLA ignores. The softmax scale with YaRN's mscale_all_dim is mlx-lm's, as transformers.
- Multi-token-prediction layers stored after the decoder's own (model.layers.{num_hidden_layers}...) are
  dropped, as transformers ignores them.
"""

from __future__ import annotations

import re

import mlx.core as mx
import mlx.nn as nn

from ..errors import WeightMismatchError
from ..untrusted import listed
from .config import ModelConfig
from .decoder import DecoderLM
from .yarn import yarn_inverse_frequencies

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
