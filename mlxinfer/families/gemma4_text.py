"""Gemma 4's text model (Gemma4ForCausalLM; also the text half of model_type "gemma4", see models/multimodal.py),
and the image half of "gemma4" (Gemma4ForConditionalGeneration: models/gemma4_vision.py's tower and an embedder).

Config rules, read the way transformers' Gemma4TextConfig does: global (full-attention) layers may have their
own head_dim and kv-head count: transformers 5.24 writes them as `per_layer_config` ({layer index: overrides}),
Google's checkpoints as `global_head_dim` and `num_global_key_value_heads` (the latter only with
attention_k_eq_v). Both become one (head_dim, kv_heads) per layer type in `args["gemma4_attention"]`, which the
layers below are built from. Reference: transformers/models/gemma4/configuration_gemma4.py.

Layers: mlx-lm's gemma4_text blocks, run by our forward (models/decoder.py) with our caches.

What transformers' Gemma4TextModel computes beyond a plain decoder, and how it is done here:
- Per-layer embeddings (PLE): a second embedding of the token ids plus a projection of the input embeddings,
  one slice per layer; computed when the tokens are embedded and handed to each layer.
- KV sharing: the last `num_kv_shared_layers` layers attend over the keys/values that the last earlier layer of
  their type computed in the same pass. Each such layer keeps a copy of them in its own cache, so every cache
  advances, trims and snapshots like any other (at the cost of the copy's memory).
- Per-layer-type head_dim and kv heads, as check_gemma4 resolves them.
mlx-lm's blocks already match transformers otherwise (norms, scale-free v norm, attention scale 1, proportional
RoPE, the MoE block, layer_scalar); its backbone `__call__` is not used.

Images (Gemma4Model.forward): an image's tokens are read as the pad token (their per-layer inputs too), then take
the embedder's output; the per-layer inputs' projection reads the embeddings with the images in place. Where the
text config says use_bidirectional_attention "vision" (the larger models), an image's tokens see each other both
ways in the sliding layers only. The processor keeps the image's shape, scaled to its token budget.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..errors import ConfigError, UnsupportedModelError
from ..formats.safetensors_header import MAX_DIM
from ..models.config import FULL, SLIDING, ModelConfig
from ..models.config_rules import MAX_EXPERTS
from ..models.decoder import DecoderLM
from ..models.gemma4_vision import Gemma4VisionConfig, Gemma4VisionTower
from ..models.mlx_lm_modules import model_module
from ..models.multimodal import text_config
from ..models.registry import GEMMA, ArchSpec
from ..models.tower_weights import renamed
from ..models.vision import ImageFormat, Layout, VisionModel, load_checked
from ..untrusted import is_finite_number, is_int, shown
from ..vision import BudgetProcessor, Processor

# Gemma4TextConfig's defaults where mlx-lm's gemma4_text has other ones (or none).
GEMMA4_DEFAULTS: dict[str, Any] = {
    "head_dim": 256, "num_key_value_heads": 4, "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
    "sliding_window": 512, "final_logit_softcapping": None, "hidden_size_per_layer_input": 256,
    "vocab_size_per_layer_input": 262_144, "attention_k_eq_v": False, "num_kv_shared_layers": 0,
    "enable_moe_block": False, "use_double_wide_mlp": False, "attention_bias": False,
}  # fmt: skip
_DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
_ROPE_KEYS = frozenset({"rope_type", "rope_theta", "partial_rotary_factor", "factor"})
_LAYER_OVERRIDES = frozenset({"head_dim", "num_key_value_heads"})
_BOOLS = ("attention_k_eq_v", "enable_moe_block", "use_double_wide_mlp")


def check_gemma4(args: dict[str, Any], source: str) -> None:
    for key in _BOOLS:
        if not isinstance(args[key], bool):
            raise ConfigError(f"{source}: {key} must be true or false, got {shown(args[key])}")
    args["layer_types"] = _layer_types(args, source)
    args["rope_parameters"] = _rope(args, source)
    attention = _attention_sizes(args, source)
    heads = args["num_attention_heads"]
    for kind, (_, kv_heads) in attention.items():
        if heads % kv_heads:
            raise ConfigError(
                f"{source}: num_attention_heads={heads} is not a multiple of {kind}'s {kv_heads} kv heads"
            )
    args["gemma4_attention"] = attention
    # What mlx-lm's module reads for the global layers (and a converted config.json says).
    args["global_head_dim"], kv_heads = attention[FULL]
    args["num_global_key_value_heads"] = kv_heads if args["attention_k_eq_v"] else None
    _check_kv_sharing(args, source)
    _check_per_layer_inputs(args, source)
    if args["enable_moe_block"]:
        _check_experts(args, source)


def _layer_types(args: dict[str, Any], source: str) -> list[Any]:
    n = args["num_hidden_layers"]
    types = args.get("layer_types")
    if types is None:  # transformers: 5 sliding then 1 full
        types = [SLIDING if (i + 1) % 6 else FULL for i in range(n)]
    if not isinstance(types, list) or not types:
        raise ConfigError(f"{source}: layer_types must be a non-empty list, got {shown(types)}")
    return [*types[:-1], FULL]  # transformers makes the last layer global whatever the list says


def _rope(args: dict[str, Any], source: str) -> dict[str, dict[str, Any]]:
    rope = args.get("rope_parameters") or _DEFAULT_ROPE
    if not isinstance(rope, dict):
        raise ConfigError(f"{source}: rope_parameters must be an object, got {shown(rope)}")
    for kind in set(args["layer_types"]) & {FULL, SLIDING}:
        section = rope.get(kind)
        if not isinstance(section, dict):
            raise ConfigError(f"{source}: rope_parameters.{kind} must be an object, got {shown(section)}")
        unknown = sorted(k for k in section if k not in _ROPE_KEYS)
        kind_of_rope = section.get("rope_type", "default")
        if unknown or kind_of_rope not in ("default", "proportional"):
            what = f"key {shown(unknown[0])}" if unknown else f"rope_type {shown(kind_of_rope)}"
            raise UnsupportedModelError(
                f"{source}: rope_parameters.{kind} {what} is not supported for gemma4_text (default or proportional)"
            )
        for key, most in (("rope_theta", float("inf")), ("partial_rotary_factor", 1.0), ("factor", float("inf"))):
            value = section.get(key, 1.0)
            if not (is_finite_number(value) and 0 < value <= most):
                name = f"rope_parameters.{kind}.{key}"
                raise ConfigError(f"{source}: {name} must be a positive number, got {shown(value)}")
    return rope


def _attention_sizes(args: dict[str, Any], source: str) -> dict[str, tuple[int, int]]:
    """(head_dim, kv_heads) of each layer type, as transformers resolves them."""
    base = (args["head_dim"], args["num_key_value_heads"])
    overrides = args.get("per_layer_config")
    if overrides is None:  # Google's form: global_head_dim defaults to 512
        head = args.get("global_head_dim", 512)
        kv = args.get("num_global_key_value_heads") if args["attention_k_eq_v"] else None
        full = (_size(head, "global_head_dim", source), _size(kv or base[1], "num_global_key_value_heads", source))
        return {SLIDING: base, FULL: full}
    if not isinstance(overrides, dict):
        raise ConfigError(f"{source}: per_layer_config must be an object, got {shown(overrides)}")
    sizes: dict[str, set[tuple[int, int]]] = {}
    for index, kind in enumerate(args["layer_types"]):
        layer = overrides.get(str(index), {})
        if not isinstance(layer, dict) or set(layer) - _LAYER_OVERRIDES:
            raise UnsupportedModelError(
                f"{source}: per_layer_config.{index} may only set head_dim and num_key_value_heads, got {shown(layer)}"
            )
        head = _size(layer.get("head_dim", base[0]), f"per_layer_config.{index}.head_dim", source)
        kv = _size(layer.get("num_key_value_heads", base[1]), f"per_layer_config.{index}.num_key_value_heads", source)
        sizes.setdefault(kind, set()).add((head, kv))
    uneven = [kind for kind, found in sizes.items() if len(found) > 1]
    if uneven:  # transformers builds one rotary table per layer type, so it cannot run these either
        raise UnsupportedModelError(f"{source}: per_layer_config gives {uneven[0]} layers different sizes")
    return {kind: next(iter(sizes.get(kind, {base}))) for kind in (SLIDING, FULL)}


def _size(value: Any, key: str, source: str) -> int:
    """A head_dim (positive and even: RoPE turns pairs) or a kv-head count (positive)."""
    even = not key.endswith("heads")
    if not (is_int(value) and 0 < value <= MAX_DIM and (value % 2 == 0 or not even)):
        kind = "a positive even integer" if even else "a positive integer"
        raise ConfigError(f"{source}: {key} must be {kind}, got {shown(value)}")
    return value


def _check_kv_sharing(args: dict[str, Any], source: str) -> None:
    """The last num_kv_shared_layers layers reuse the keys/values of the last earlier layer of their type."""
    n, shared = args["num_hidden_layers"], args["num_kv_shared_layers"]
    if not (is_int(shared) and 0 <= shared < n):
        raise ConfigError(f"{source}: num_kv_shared_layers must be an integer from 0 to {n - 1}, got {shown(shared)}")
    types = args["layer_types"]
    missing = sorted(set(types[n - shared :]) - set(types[: n - shared]))
    if missing:
        raise ConfigError(
            f"{source}: num_kv_shared_layers={shared} leaves no earlier {missing[0]} layer to share keys/values with"
        )


def _check_per_layer_inputs(args: dict[str, Any], source: str) -> None:
    width = args["hidden_size_per_layer_input"]
    if not (is_int(width) and 0 <= width <= MAX_DIM):
        raise ConfigError(f"{source}: hidden_size_per_layer_input must be an integer >= 0, got {shown(width)}")
    vocab = args["vocab_size_per_layer_input"]
    if width and not (is_int(vocab) and args["vocab_size"] <= vocab <= MAX_DIM):
        raise ConfigError(
            f"{source}: vocab_size_per_layer_input must be an integer of at least vocab_size="
            f"{args['vocab_size']} (every token needs a per-layer embedding), got {shown(vocab)}"
        )
    if width * args["num_hidden_layers"] > MAX_DIM:
        raise ConfigError(f"{source}: the per-layer embeddings are wider than {MAX_DIM}, the largest dimension MLX has")


def _check_experts(args: dict[str, Any], source: str) -> None:
    experts, top, width = args.get("num_experts"), args.get("top_k_experts"), args.get("moe_intermediate_size")
    if not (is_int(experts) and 0 < experts <= MAX_EXPERTS):
        raise ConfigError(f"{source}: num_experts must be a positive integer for the MoE block, got {shown(experts)}")
    if not (is_int(top) and 0 < top <= experts):
        raise ConfigError(f"{source}: top_k_experts must be from 1 to num_experts={experts}, got {shown(top)}")
    if not (is_int(width) and 0 < width <= MAX_DIM // 2):
        raise ConfigError(f"{source}: moe_intermediate_size must be a positive integer, got {shown(width)}")


# ---- Layers ----

_gemma4, _base = model_module("gemma4_text"), model_module("base")


class PassState:
    """What one forward pass shares across layers: per-layer inputs, each layer type's newest keys/values."""

    def __init__(self) -> None:
        self.per_layer: mx.array | None = None  # (B, L, layers, hidden_size_per_layer_input)
        self.kv: dict[str, tuple[mx.array, mx.array]] = {}


def adapt(model: DecoderLM, config: ModelConfig) -> None:
    args = _gemma4.ModelArgs.from_dict({**config.args, "layer_types": list(config.layer_types)})
    state = PassState()
    layers = []
    for index, kind in enumerate(config.layer_types):
        head_dim, kv_heads = config.args["gemma4_attention"][kind]
        # mlx-lm picks global or plain sizes by layer type; both name this layer's own.
        sized = replace(args, head_dim=head_dim, global_head_dim=head_dim,
                        num_key_value_heads=kv_heads, num_global_key_value_heads=kv_heads)  # fmt: skip
        layers.append(Gemma4Layer(sized, index, state))
    model.model.layers = layers
    model.__class__ = Gemma4LM  # a DecoderLM whose `embed` also computes the per-layer inputs
    model.pass_state = state
    model.pad_token_id = config.args.get("pad_token_id") or 0


class Gemma4LM(DecoderLM):
    pass_state: PassState
    pad_token_id: int

    def embed(self, tokens: mx.array) -> mx.array:
        return self.embed_with(tokens, None)

    def embed_with(self, tokens: mx.array, images: Any) -> mx.array:
        """As Gemma4Model.forward: image tokens read as the pad token, their embeddings then the images'; the
        per-layer inputs from those ids and from the embeddings with the images in place."""
        if images is not None:
            tokens = mx.where(images.token_mask(tokens.shape[1])[None], self.pad_token_id, tokens)
        h = super().embed(tokens)  # scaled by sqrt(hidden_size)
        if images is not None:
            h = images.place(h)
        backbone = self.model
        self.pass_state.kv.clear()
        if backbone.hidden_size_per_layer_input:
            by_token = backbone._get_per_layer_inputs(tokens)
            self.pass_state.per_layer = backbone._project_per_layer_inputs(h, by_token)
        return h


class Gemma4Layer(_gemma4.DecoderLayer):
    """mlx-lm's block, called as our forward calls every layer: (h, mask, cache) -> h."""

    def __init__(self, args: Any, index: int, state: PassState):
        super().__init__(args, index)
        self.self_attn = SharedKVAttention(args, index, state)
        self._state, self._index = state, index

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any = None) -> mx.array:
        per_layer = self._state.per_layer
        per_layer = per_layer[:, :, self._index] if self.hidden_size_per_layer_input else None
        return super().__call__(x, mask, cache, per_layer_input=per_layer)[0]


class SharedKVAttention(_gemma4.Attention):
    """mlx-lm's Gemma 4 attention; a KV-shared layer takes the keys/values its producer wrote into the pass state."""

    def __init__(self, args: Any, index: int, state: PassState):
        super().__init__(args, index)
        self._state = state

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any = None, **_unused) -> tuple:
        B, L, _ = x.shape
        offset = cache.offset if cache is not None else 0
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim)).transpose(0, 2, 1, 3)
        q = self.rope(q, offset=offset)  # (B, heads, L, head_dim)
        if self.has_kv:
            k = self.k_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
            v = k if self.use_k_eq_v else self.v_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
            k = self.rope(self.k_norm(k).transpose(0, 2, 1, 3), offset=offset)
            v = self.v_norm(v).transpose(0, 2, 1, 3)
            self._state.kv[self.layer_type] = (k, v)  # the last of its type before the shared layers wins
        else:
            k, v = self._state.kv[self.layer_type]
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = _base.scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1)), None, None


# ---- Gemma 4's image half (model_type "gemma4") ----
# Stored prefixes (transformers', mlx-vlm's) -> this module's names; the audio half is never read.
IMAGE_PREFIXES = {"model.vision_tower.": "vision_tower.", "vision_tower.": "vision_tower.",
                  "model.embed_vision.": "embed_vision.", "embed_vision.": "embed_vision."}  # fmt: skip
BOI, IMAGE, EOI = "<|image>", "<|image|>", "<image|>"  # Gemma 4's tokenizer's boi_token, image_token, eoi_token
MOST_TOKENS = 1120  # the largest budget Gemma4ImageProcessor names


class Embedder(nn.Module):
    """Gemma4MultimodalEmbedder: an RMS norm without scale, then a projection to the text width."""

    def __init__(self, width: int, text_width: int, eps: float):
        super().__init__()
        self.eps = eps
        self.embedding_projection = nn.Linear(width, text_width, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.embedding_projection(mx.fast.rms_norm(x, None, self.eps))


class Gemma4Vision(VisionModel):
    converts_whole = True  # mlx-lm's gemma4 module reads the wrapper's layout (and drops the image half)

    def __init__(self, tower: Gemma4VisionConfig, text_width: int, image_format: ImageFormat):
        super().__init__()
        self.vision_tower = Gemma4VisionTower(tower)
        self.embed_vision = Embedder(tower.hidden_size, text_width, tower.rms_norm_eps)
        self.format = image_format
        self._patches = MOST_TOKENS * tower.pooling_kernel_size**2  # the processor's budget, once fitted

    def fitted(self, processor: Processor) -> Processor:
        """Gemma4ImageProcessor, its patches and pooling the tower's."""
        config = self.vision_tower.config
        if not isinstance(processor, BudgetProcessor):
            raise UnsupportedModelError(f"Gemma 4 reads images with Gemma4ImageProcessor, not {processor!r}")
        if (processor.patch, processor.pooling) != (config.patch_size, config.pooling_kernel_size):
            raise ConfigError(
                f"preprocessor_config.json: patch_size {processor.patch} and pooling_kernel_size "
                f"{processor.pooling} must be config.json's vision_config ({config.patch_size}, "
                f"{config.pooling_kernel_size})"
            )
        strip = processor.max_soft_tokens * processor.pooling  # patches along a one-token-high image
        if strip > config.position_embedding_size:
            raise ConfigError(
                f"config.json: vision_config.position_embedding_size {config.position_embedding_size} is shorter "
                f"than the {strip} patches a side preprocessor_config.json's budget allows"
            )
        self._patches = processor.max_soft_tokens * processor.pooling**2
        return processor

    def activation_bytes(self, frames: int) -> int:
        return frames * self.vision_tower.config.activation_bytes(self._patches, self._dtype.size)

    @property
    def _dtype(self) -> mx.Dtype:
        return self.embed_vision.embedding_projection.weight.dtype

    def __call__(self, pixels: mx.array) -> mx.array:
        """One image's pixel_values (1, 3, H, W) -> (1, tokens, text hidden), tokens row by row."""
        return self.embed_vision(self.vision_tower(pixels[0]).astype(self._dtype))[None]


def _tokens(layout: Layout) -> int:
    if layout.grid is None:
        raise ConfigError("Gemma 4 sizes images by their content; its processor must give a grid of tokens")
    return layout.grid[0] * layout.grid[1]


def vision(raw: dict[str, Any], weights: dict[str, mx.array], dtype: mx.Dtype, source: str) -> Gemma4Vision:
    """Gemma4ForConditionalGeneration's image half from its config.json and tensors (the audio half skipped)."""
    tower = Gemma4VisionConfig.from_dict(raw.get("vision_config"), source)
    token = raw.get("image_token_id", 258_880)
    if not is_int(token) or token < 0:
        raise ConfigError(f"{source}: image_token_id must be a non-negative integer, got {shown(token)}")
    text = text_config(raw, source)
    both_ways = text.get("use_bidirectional_attention") == "vision"  # the larger models': sliding layers only
    image_format = ImageFormat(IMAGE, token, MOST_TOKENS, bidirectional=both_ways,
                               expansion=lambda layout: BOI + IMAGE * _tokens(layout) + EOI,
                               frame_runs=lambda layout: [(_tokens(layout),)], bidirectional_in=(SLIDING,))  # fmt: skip
    model = Gemma4Vision(tower, text["hidden_size"], image_format)
    kept = {k: v for k, v in weights.items() if k.startswith(tuple(IMAGE_PREFIXES))}
    load_checked(model, renamed(kept, IMAGE_PREFIXES, ""), dtype, source,
                 (raw.get("quantization") or {}).get("mode", "affine"))  # fmt: skip
    return model


VISION = {"gemma4": vision}


def mlx_lm_form(config: ModelConfig) -> dict[str, Any]:
    """transformers 5 writes per_layer_config; mlx-lm reads the global layers' sizes at the top level."""
    return {key: config.args[key] for key in ("global_head_dim", "num_global_key_value_heads")}


SPECS = {
    "gemma4_text": ArchSpec(
        "gemma4_text",
        mlx_lm_form=mlx_lm_form,
        sliding="declared",  # check_gemma4 writes transformers' layer_types
        keeps_layer_types=True,
        neutral={"attention_bias": False},
        defaults=GEMMA4_DEFAULTS,
        check_config=check_gemma4,
        mlx_sanitize=True,
        adapt=adapt,
        **GEMMA,
    ),
}
