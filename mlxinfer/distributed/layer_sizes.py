"""A checkpoint's bytes per decoder layer and shared by every rank, from its headers alone.

Nothing is loaded, so a 70B model can be planned on a laptop. Tensors named `model.layers.<i>.` belong
to layer i (as models/shard.py's Stage splits them); every other tensor (embeddings, final norm, head)
is held by every rank. Each layer's cache (KV or recurrent state) is the planner's (models/footprint.py).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from ..defaults import PREFILL_CHUNK_TOKENS
from ..errors import ModelNotFoundError
from ..formats.gguf_file import GGUFFile
from ..formats.safetensors_header import DTYPE_BYTES, FLOAT_DTYPES
from ..memory.planner import RUNTIME_BYTES
from ..models.checkpoint import open_folder
from ..models.config import ModelConfig, normalize_config
from ..models.dtype import DTYPES
from ..models.footprint import check_kv_bits, config_footprint, layer_cache_bytes
from ..models.gguf import gguf_config, gguf_tensors
from ..models.multimodal import text_checkpoint
from ..models.sizing import StoredTensor, check_checkpoint

_LAYER = re.compile(r"model\.layers\.(\d+)\.")
HOSTS_DTYPE = "bfloat16"  # Apple GPUs compute in half precision (float16 before the M2: the same 2 bytes)
MAX_DEFAULT_CONTEXT = 32768  # as Model.memory_plan: a model's trained length, at most this


@dataclass(frozen=True)
class LayerSizes:
    """What each decoder layer and every rank's shared part take, at `context` tokens in `dtype`."""

    source: str
    dtype: str
    kv_bits: int | None
    context: int
    hidden_size: int
    layer_weight_bytes: tuple[int, ...]
    layer_kv_bytes: tuple[int, ...]  # the KV cache at `context` tokens, or a recurrent layer's state
    layer_parameters: tuple[int, ...]  # for the compute estimate
    shared_weight_bytes: int  # embeddings, final norm, head: on every rank
    head_weight_bytes: int  # what computing the logits reads per token
    head_parameters: int
    working_bytes: int  # every rank: a prefill chunk's activations at `context` and MLX's runtime buffers
    notes: tuple[str, ...] = ()

    @property
    def layer_bytes(self) -> tuple[int, ...]:
        """Each layer's weights and its KV cache at `context`: what a host holding it must have."""
        return tuple(w + kv for w, kv in zip(self.layer_weight_bytes, self.layer_kv_bytes, strict=True))

    @property
    def shared_bytes(self) -> int:
        """What every rank holds whatever its layers."""
        return self.shared_weight_bytes + self.working_bytes

    @property
    def activation_bytes(self) -> int:
        """One token's hidden state, as a hop sends it."""
        return self.hidden_size * DTYPES[self.dtype].size


def read_layer_sizes(
    path: str | Path, context: int | None = None, dtype: str | None = None, kv_bits: int | None = None
) -> LayerSizes:
    """Sizes of the model at `path` (a folder or a .gguf file) from its headers; `dtype` defaults to the half
    precision Apple GPUs compute in, `context` to the model's trained length (at most 32768)."""
    path = Path(path).expanduser()
    dtype = dtype or HOSTS_DTYPE
    size = DTYPES[dtype].size
    if path.is_file() and path.suffix == ".gguf":
        with GGUFFile(path) as gguf:
            config = normalize_config(gguf_config(gguf), source=f"{path} (GGUF metadata)")
            tensors = gguf_tensors(gguf, size)
        packed: set[str] = set()
    elif path.is_dir():
        checkpoint = text_checkpoint(open_folder(path))
        config = normalize_config(checkpoint.config, source=str(path / "config.json"))
        tensors, packed = _folder_tensors(checkpoint.tensors, size)
    else:
        raise ModelNotFoundError(f"{path}: not a model folder or .gguf file")
    check_checkpoint(config, {name: t.shape for name, t in tensors.items()}, str(path), packed)
    check_kv_bits(kv_bits, config)
    if context is None:
        context = min(int(config.args.get("max_position_embeddings") or MAX_DEFAULT_CONTEXT), MAX_DEFAULT_CONTEXT)
    return _sizes(config, tensors, packed, str(path), dtype, kv_bits, context)


def _folder_tensors(infos: dict, size: int) -> tuple[dict[str, StoredTensor], set[str]]:
    """Each safetensors tensor's bytes once loaded (floats in the compute dtype, packed weights as stored)."""
    packed = {n for n, i in infos.items() if i.dtype == "U32" and f"{n.removesuffix('.weight')}.scales" in infos}
    tensors = {
        name: StoredTensor(
            info.shape, math.prod(info.shape) * (size if info.dtype in FLOAT_DTYPES else DTYPE_BYTES[info.dtype])
        )
        for name, info in infos.items()
    }
    return tensors, packed


def _sizes(
    config: ModelConfig,
    tensors: dict[str, StoredTensor],
    packed: set[str],
    source: str,
    dtype: str,
    kv_bits: int | None,
    context: int,
) -> LayerSizes:
    n = config.num_layers
    weights, params = [0] * n, [0] * n
    shared = head = head_params = 0
    bits = int((config.quantization or {}).get("bits") or 4)
    head_prefix = "model.embed_tokens." if config.tie_word_embeddings else "lm_head."
    for name, tensor in tensors.items():
        if _dropped(name, config):
            continue
        count = _parameters(name, tensor, packed, bits)
        match = _LAYER.match(name)
        if match is None:
            shared += tensor.loaded_bytes
            if name.startswith(head_prefix):
                head, head_params = head + tensor.loaded_bytes, head_params + count
        elif int(match.group(1)) < n:  # later ones: multi-token-prediction layers the decoder never runs
            weights[int(match.group(1))] += tensor.loaded_bytes
            params[int(match.group(1))] += count
    footprint = config_footprint(config, DTYPES[dtype].size, kv_bits)  # weights: from the headers above
    return LayerSizes(
        source=source,
        dtype=dtype,
        kv_bits=kv_bits,
        context=context,
        hidden_size=config.hidden_size,
        layer_weight_bytes=tuple(weights),
        layer_kv_bytes=layer_cache_bytes(config, footprint, context),
        layer_parameters=tuple(params),
        shared_weight_bytes=shared,
        head_weight_bytes=head,
        head_parameters=head_params,
        working_bytes=footprint.activation_bytes(min(PREFILL_CHUNK_TOKENS, context), context) + RUNTIME_BYTES,
        notes=_notes(config),
    )


def _dropped(name: str, config: ModelConfig) -> bool:
    """Tensors the loader drops (models/loader.py _sanitize): a tied head's copy, precomputed rotary tables."""
    return (config.tie_word_embeddings and name.startswith("lm_head.")) or name.endswith("rotary_emb.inv_freq")


def _parameters(name: str, tensor: StoredTensor, packed: set[str], bits: int) -> int:
    """Weights for the compute estimate: a packed weight's uint32 words hold 32 / bits each; its scales and
    biases are not weights."""
    stem = name.rsplit(".", 1)[0]
    if name.endswith((".scales", ".biases")) and f"{stem}.weight" in packed:
        return 0
    count = math.prod(tensor.shape)
    return count * 32 // bits if name in packed else count


def _notes(config: ModelConfig) -> tuple[str, ...]:
    """What the sizes assume that the config could not tell."""
    if len(config.layer_types) != config.num_layers:
        return ("layer kinds unknown (unverified model_type): every layer's KV counted as full attention",)
    return ()
