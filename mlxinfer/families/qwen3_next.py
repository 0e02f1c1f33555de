"""Qwen3-Next and Qwen3.5 (text, dense or MoE): Gated DeltaNet layers between full-attention ones.

Covers three model_types, which share their config checks and layers: qwen3_next (Qwen3NextForCausalLM),
qwen3_5_text and qwen3_5_moe_text (the text halves of qwen3_5 / qwen3_5_moe, see models/multimodal.py), whose
attention layers rotate by M-RoPE; their image half (Qwen's tower, shared with Qwen3-VL) is at the end of this file.
transformers picks each layer's block from `layer_types` (or, without it, puts full attention on every
`full_attention_interval`-th layer); mlx-lm's modules always use the interval. So the interval handed to mlx-lm
is rewritten from layer_types, and a layout no interval describes is refused. mlx-lm's qwen3_5 reads RoPE from
rope_parameters with its own defaults (theta 1e5 when the key is absent), so every attention layer gets the RoPE
of the normalized config. Reference: transformers' configuration_qwen3_next.py and modeling_qwen3_next.py.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

import mlx.core as mx

from ..errors import ConfigError, UnsupportedModelError, WeightMismatchError
from ..formats.safetensors_header import MAX_DIM
from ..models.config import FULL, MAX_LAYERS, ModelConfig
from ..models.config_rules import check_experts, expert_count, positive_int
from ..models.decoder import DecoderLM
from ..models.mlx_lm_modules import model_module
from ..models.moe_weights import QWEN, to_switch_layout
from ..models.multimodal import text_config
from ..models.qwen_vision import QwenVisionConfig, QwenVisionTower
from ..models.registry import ArchSpec
from ..models.shared_layers import shared_mrope
from ..models.tower_weights import bounded_int, renamed
from ..models.vision import ImageFormat, VisionModel, load_checked
from ..untrusted import is_int, listed, shown
from ..vision import Layout, PixelRangeProcessor, Processor

LINEAR = "linear_attention"
MAX_EXPERTS = 16_384  # the largest real MoE models route among a few hundred
MAX_CONV_KERNEL = 64  # the short convolution before the delta rule: 4 in every real model

# transformers' defaults (Qwen3NextConfig / Qwen3_5TextConfig) for keys mlx-lm needs or defaults differently.
_LINEAR_DEFAULTS: dict[str, Any] = {
    "head_dim": 256, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "rope_theta": 10_000.0,
    "partial_rotary_factor": 0.25,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32,
}  # fmt: skip
QWEN3_5_DEFAULTS: dict[str, Any] = dict(_LINEAR_DEFAULTS)
QWEN3_NEXT_DEFAULTS: dict[str, Any] = {
    **_LINEAR_DEFAULTS,
    "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1, "norm_topk_prob": True, "mlp_only_layers": [],
}  # fmt: skip
QWEN3_5_MOE_DEFAULTS: dict[str, Any] = {
    **QWEN3_5_DEFAULTS, "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
}  # fmt: skip


def check_qwen3_next(args: dict[str, Any], source: str) -> None:
    """Refuse sizes that cannot build, and make mlx-lm's full_attention_interval say what layer_types says."""
    _check_linear_attention(args, source)
    _check_experts(args, source)
    _set_full_attention_interval(args, source)


def check_qwen3_5_text(args: dict[str, Any], source: str) -> None:
    """As check_qwen3_next, for Qwen3.5's dense text model (no experts)."""
    _check_linear_attention(args, source)
    _set_full_attention_interval(args, source)


def check_qwen3_5_moe(args: dict[str, Any], source: str) -> None:
    """As Qwen3.5's text model, with experts and a gated shared expert on every layer."""
    check_qwen3_5_text(args, source)
    check_experts(args, source, expert_count(args, source, "num_experts", "num_local_experts", 256), False)
    positive_int(args, "moe_intermediate_size", source)
    positive_int(args, "shared_expert_intermediate_size", source)
    # transformers always renormalizes the top-k weights and puts experts on every layer (it reads neither key);
    # mlx-lm's block reads norm_topk_prob.
    args["norm_topk_prob"], args["decoder_sparse_step"], args["mlp_only_layers"] = True, 1, []


def _int_in(args: dict[str, Any], key: str, low: int, high: int, source: str) -> int:
    value = args.get(key)
    if not (is_int(value) and low <= value <= high):
        raise ConfigError(f"{source}: {key} must be an integer from {low} to {high}, got {shown(value)}")
    return value


def _check_linear_attention(args: dict[str, Any], source: str) -> None:
    key_heads = _int_in(args, "linear_num_key_heads", 1, MAX_DIM, source)
    value_heads = _int_in(args, "linear_num_value_heads", 1, MAX_DIM, source)
    key_dim = _int_in(args, "linear_key_head_dim", 1, MAX_DIM, source)
    value_dim = _int_in(args, "linear_value_head_dim", 1, MAX_DIM, source)
    # A kernel of 1 keeps no state; it would also make the two conv weight layouts indistinguishable.
    _int_in(args, "linear_conv_kernel_dim", 2, MAX_CONV_KERNEL, source)
    if value_heads % key_heads:
        raise ConfigError(
            f"{source}: linear_num_value_heads={value_heads} is not a multiple of linear_num_key_heads={key_heads}"
        )
    # in_proj_qkvz's output (q, k, v, z) is one dimension: keep it 32-bit.
    fused = 2 * key_heads * key_dim + 2 * value_heads * value_dim
    if fused > MAX_DIM:
        raise ConfigError(f"{source}: the linear attention projections ({fused} outputs) exceed {MAX_DIM}")


def _check_experts(args: dict[str, Any], source: str) -> None:
    if args.get("mlp_only_layers") is None:  # transformers reads null as "none"
        args["mlp_only_layers"] = []
    only = args["mlp_only_layers"]
    if not isinstance(only, list) or len(only) > MAX_LAYERS or not all(is_int(i) for i in only):
        raise ConfigError(f"{source}: mlp_only_layers must be a list of layer indices, got {shown(only)}")
    experts = _int_in(args, "num_experts", 0, MAX_EXPERTS, source)
    if experts == 0:  # every layer is a dense MLP of intermediate_size
        return
    _int_in(args, "num_experts_per_tok", 1, experts, source)
    _int_in(args, "moe_intermediate_size", 1, MAX_DIM, source)
    _int_in(args, "shared_expert_intermediate_size", 1, MAX_DIM, source)
    _int_in(args, "decoder_sparse_step", 1, MAX_LAYERS, source)
    if not isinstance(args.get("norm_topk_prob"), bool):
        raise ConfigError(f"{source}: norm_topk_prob must be true or false, got {shown(args.get('norm_topk_prob'))}")


def _set_full_attention_interval(args: dict[str, Any], source: str) -> None:
    n = args["num_hidden_layers"]
    declared = args.get("layer_types")
    if declared is None:  # transformers' rule, which is also mlx-lm's
        args.setdefault("full_attention_interval", 4)
        every = _int_in(args, "full_attention_interval", 1, MAX_LAYERS, source)
        args["layer_types"] = [LINEAR if (i + 1) % every else FULL for i in range(n)]
        return
    types = declared[: n + 1]  # one past n is enough to refuse a wrong length
    if len(types) != n or not all(t in (FULL, LINEAR) for t in types):
        raise UnsupportedModelError(
            f"{source}: layer_types must list num_hidden_layers={n} entries of {FULL!r}/{LINEAR!r}, "
            f"got {shown(declared)}"
        )
    # The first full layer fixes the interval; without one, an interval past the last layer builds none.
    every = types.index(FULL) + 1 if FULL in types else n + 1
    if any((t == FULL) != ((i + 1) % every == 0) for i, t in enumerate(types)):
        raise UnsupportedModelError(
            f"{source}: layer_types {shown(declared)} does not put full attention on every Nth layer, "
            f"the only layout {args['model_type']} is implemented for"
        )
    args["full_attention_interval"] = every


# ---- Layers ----


def adapt(model: DecoderLM, config: ModelConfig) -> None:
    """Check each layer's block, set its RoPE, and convert the checkpoint's layout when it loads."""
    args = config.args
    initialize_rope = model_module("rope_utils").initialize_rope
    for i, (layer, kind) in enumerate(zip(model.layers, config.layer_types)):
        if layer.is_linear != (kind == LINEAR):
            built = "linear attention" if layer.is_linear else "full attention"
            raise UnsupportedModelError(f"{config.source}: layer {i} was built as {built}; layer_types says {kind}")
        if not layer.is_linear:
            attn = layer.self_attn
            dims = int(attn.head_dim * args["partial_rotary_factor"])
            mrope = shared_mrope(model, args, dims, config.source)
            if mrope is not None:  # Qwen3.5: images' tokens take 2-D positions (text alone rotates as plain RoPE)
                attn.rope = mrope
                continue
            attn.rope = initialize_rope(
                dims,
                base=args["rope_theta"],
                traditional=False,
                scaling_config=args.get("rope_scaling"),
                max_position_embeddings=args.get("max_position_embeddings"),
            )
    model.mlx_sanitize = partial(to_mlx_layout, num_experts=int(args.get("num_experts") or 0))


def adapt_moe(model: DecoderLM, config: ModelConfig) -> None:
    """Qwen3.5-MoE: as Qwen3.5, and the experts of either layout (per expert, or fused as the Hub checkpoints
    store them) stacked for mlx-lm."""
    adapt(model, config)
    model.mlx_sanitize = _then_split_fused(model.mlx_sanitize, int(config.args["num_experts"]), config.source)


def _then_split_fused(
    qwen_layout: Callable[[dict[str, mx.array]], dict[str, mx.array]], experts: int, source: str
) -> Callable[[dict[str, mx.array]], dict[str, mx.array]]:
    # Qwen's conversion first (it decides from the conv kernels whether the folder is already in MLX's layout,
    # and shifts the norms); it stacks per-expert tensors and leaves fused ones for to_switch_layout.
    def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return to_switch_layout(qwen_layout(weights), QWEN, experts, source)

    return sanitize


# ---- Weights: Qwen3-Next / Qwen3.5 tensors in transformers' layout -> mlx-lm's parameters.
#
# Three differences (transformers' modeling_qwen3_next.py vs mlx-lm's qwen3_next.py):
# per-expert matrices are stacked into one (experts, out, in) tensor per projection; the
# depthwise conv weight (channels, 1, kernel) becomes (channels, kernel, 1); and the
# zero-centred RMSNorms (stored w, applied as 1 + w) store 1 + w, since mlx-lm applies
# its weight as is. The gated norm inside linear attention stores its scale and stays.
# A checkpoint already in mlx-lm's layout (an MLX conversion) passes through unchanged.

_EXPERT = re.compile(r"(.+\.mlp)\.experts\.(0|[1-9][0-9]{0,8})\.(gate_proj|up_proj|down_proj)\.weight")
_ZERO_CENTRED = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".self_attn.q_norm.weight",
                 ".self_attn.k_norm.weight")  # fmt: skip
_FINAL_NORM = "model.norm.weight"


def to_mlx_layout(weights: dict[str, mx.array], num_experts: int) -> dict[str, mx.array]:
    """`weights` with experts stacked, conv weights transposed and zero-centred norms shifted by one.

    Multi-token-prediction tensors (`mtp.*`, a draft head the decoder does not run) are dropped."""
    weights = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
    if is_mlx_layout(weights):
        return weights
    weights = _stack_experts(weights, num_experts)
    for name, value in weights.items():
        if name.endswith(".linear_attn.conv1d.weight") and value.ndim == 3:
            weights[name] = value.swapaxes(1, 2)  # (C, 1, K) -> (C, K, 1)
        elif (name == _FINAL_NORM or name.endswith(_ZERO_CENTRED)) and value.ndim == 1:
            weights[name] = value + 1.0
    return weights


def is_mlx_layout(weights: dict[str, mx.array]) -> bool:
    """Whether an MLX conversion wrote `weights` (its conv kernels lie on axis 1; kernel size is at least 2)."""
    convs = [v for k, v in weights.items() if k.endswith(".linear_attn.conv1d.weight") and v.ndim == 3]
    if convs:
        return convs[0].shape[1] != 1
    return any(".mlp.switch_mlp." in k for k in weights)


def _stack_experts(weights: dict[str, mx.array], num_experts: int) -> dict[str, mx.array]:
    groups: dict[tuple[str, str], dict[int, str]] = defaultdict(dict)
    for name in weights:
        if m := _EXPERT.fullmatch(name):
            groups[m.group(1), m.group(3)][int(m.group(2))] = name
    wrong = [f"{mlp}.experts.*.{proj} ({len(found)} of {num_experts})" for (mlp, proj), found in groups.items()
             if sorted(found) != list(range(num_experts))]  # fmt: skip
    if wrong:
        raise WeightMismatchError(f"expected experts 0 to {num_experts - 1} in each of {listed(sorted(wrong))}")
    for (mlp, proj), found in groups.items():
        weights[f"{mlp}.switch_mlp.{proj}.weight"] = mx.stack([weights.pop(found[e]) for e in range(num_experts)])
    return weights


def _mlx_lm_form(module: str, config: ModelConfig) -> dict[str, Any]:
    """mlx-lm's qwen3_5 modules read a flat text config, and place full attention by the interval alone (default 4,
    whatever layer_types says)."""
    return {"model_type": module, "full_attention_interval": config.args["full_attention_interval"]}


_LINEAR_HYBRID = dict(
    sliding="declared",
    gated_queries=True,
    recurrent_kinds=frozenset({"linear_attention"}),
    rope_types=frozenset({"default"}),
    partial_rotary=True,
    mlx_sanitize=True,
)
SPECS = {
    # check_qwen3_next writes layer_types from full_attention_interval when absent.
    "qwen3_next": ArchSpec(
        "qwen3_next",
        defaults=QWEN3_NEXT_DEFAULTS,
        check_config=check_qwen3_next,
        adapt=adapt,
        hf_class="Qwen3NextForCausalLM",
        **_LINEAR_HYBRID,
    ),
    # mlx-lm has no qwen3_5_text module: its qwen3_5 takes the flat config.
    "qwen3_5_text": ArchSpec(
        "qwen3_5",
        neutral={"num_experts": 0},  # a dense model: mlx-lm would build experts from this key, transformers not
        defaults=QWEN3_5_DEFAULTS,
        check_config=check_qwen3_5_text,
        adapt=adapt,
        hf_class="Qwen3_5ForCausalLM",
        mlx_lm_form=partial(_mlx_lm_form, "qwen3_5"),
        **_LINEAR_HYBRID,
    ),
    "qwen3_5_moe_text": ArchSpec(
        "qwen3_5",
        defaults=QWEN3_5_MOE_DEFAULTS,
        check_config=check_qwen3_5_moe,
        adapt=adapt_moe,
        mlx_lm_form=partial(_mlx_lm_form, "qwen3_5_moe"),  # no qwen3_5_moe_text in mlx-lm either
        **_LINEAR_HYBRID,
    ),
}

# ---- Images (Qwen3.5): the tower of models/qwen_vision.py, its merger the projector ----


class QwenVision(VisionModel):
    """Qwen3.5's and Qwen3-VL's image half: the tower with its mergers (the projector is the merger)."""

    converts_whole = True  # mlx-lm's qwen3_5 and qwen3_vl modules read the wrapper's layout (and drop the tower)

    def __init__(self, config: QwenVisionConfig, temporal_patch: int, image_format: ImageFormat):
        super().__init__()
        self.visual = QwenVisionTower(config, temporal_patch)
        self.format = image_format
        self.deep_layers = len(config.deepstack)

    def fitted(self, processor: Processor) -> Processor:
        """Qwen2VLImageProcessor, its patches and merged blocks the tower's; the format then allows its largest
        image's tokens."""
        config = self.visual.config
        if not isinstance(processor, PixelRangeProcessor):
            raise UnsupportedModelError(
                f"Qwen's vision models read images with Qwen2VLImageProcessor, not {processor!r}"
            )
        if (processor.patch, processor.merge) != (config.patch_size, config.spatial_merge_size):
            raise ConfigError(
                f"preprocessor_config.json: patch_size {processor.patch} and merge_size {processor.merge} must be "
                f"config.json's vision_config patch_size {config.patch_size} and spatial_merge_size "
                f"{config.spatial_merge_size}"
            )
        self.format = replace(self.format, tokens_per_frame=processor.most_tokens)
        return processor

    def exported(self, name: str) -> str:
        return "vision_tower." + name.removeprefix("visual.")  # mlx-vlm's name for the tower

    def activation_bytes(self, frames: int) -> int:
        patches = self.format.tokens_per_frame * self.visual.config.spatial_merge_size**2
        return frames * self.visual.config.activation_bytes(patches, self._dtype.size)

    @property
    def _dtype(self) -> mx.Dtype:
        return self.visual.merger.linear_fc1.weight.dtype

    def __call__(self, pixels: mx.array) -> mx.array:
        """One image's pixel_values (1, 3, H, W) -> (1, tokens, text hidden), tokens row by row; with deepstack,
        each token's features for the first layers follow its own (1, tokens, (1 + deep_layers) * text hidden)."""
        tokens, deep = self.visual(pixels[0].astype(self._dtype))
        return mx.concatenate([tokens, *deep], axis=-1)[None]


_PREFIXES = {"model.visual.": "visual.", "visual.": "visual.", "vision_tower.": "visual."}
_CONV = "visual.patch_embed.proj.weight"


def qwen_vision(raw: dict[str, Any], weights: dict[str, mx.array], dtype: mx.Dtype, source: str) -> QwenVision:
    """Qwen3_5ForConditionalGeneration's (and Qwen3VLForConditionalGeneration's) image half from its config.json and
    tensors: the placeholder its chat template writes becomes one <|image_pad|> a token between the markers."""
    config = QwenVisionConfig.from_dict(raw.get("vision_config"), source)
    temporal = bounded_int((raw.get("vision_config") or {}).get("temporal_patch_size", 2), 16,
                           f"{source}: vision_config.temporal_patch_size")  # fmt: skip
    token = raw.get("image_token_id", 151_655)  # Qwen3VLConfig's default
    if not is_int(token) or token < 0:
        raise ConfigError(f"{source}: image_token_id must be a non-negative integer, got {shown(token)}")
    text_width = text_config(raw, source)["hidden_size"]
    if config.out_hidden_size != text_width:
        raise ConfigError(
            f"{source}: vision_config.out_hidden_size {config.out_hidden_size} must be the text model's hidden_size "
            f"{text_width}"
        )
    image_format = ImageFormat(
        placeholder="<|vision_start|><|image_pad|><|vision_end|>",
        image_token_id=token,
        tokens_per_frame=1,  # until fitted to the processor, whose max_pixels bound an image's tokens
        bidirectional=False,
        expansion=_expansion,
        frame_runs=lambda layout: [(math.prod(_grid(layout)),)],
        grid_positions=True,
    )
    model = QwenVision(config, temporal, image_format)
    tensors = renamed(weights, _PREFIXES, "")
    conv = tensors.get(_CONV)
    if conv is not None and conv.ndim == 5 and conv.shape[1] == 3 and conv.shape[-1] != 3:
        tensors[_CONV] = conv.transpose(0, 2, 3, 4, 1)  # PyTorch's (out, in, t, kh, kw) -> MLX's channels last
    load_checked(model, tensors, dtype, source, (raw.get("quantization") or {}).get("mode", "affine"))
    return model


def _expansion(layout: Layout) -> str:
    """Qwen3VLProcessor's: one <|image_pad|> a token of the image's grid, between the markers."""
    return "<|vision_start|>" + "<|image_pad|>" * math.prod(_grid(layout)) + "<|vision_end|>"


def _grid(layout: Layout) -> tuple[int, int]:
    if layout.grid is None:
        raise ConfigError("Qwen's vision models size images by their content; the processor must give a grid")
    return layout.grid


VISION = {"qwen3_5": qwen_vision, "qwen3_5_moe": qwen_vision}
