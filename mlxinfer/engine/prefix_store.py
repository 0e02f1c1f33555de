"""Where a loaded model's warmed prefixes live on disk, and what every file there must hold.

The layout of a prefix file comes from the model, never from the file: each
layer's kind, the attention shapes, and each recurrent layer's state shapes
(learned by running one token through a fresh cache). The folder is named by a
fingerprint of the weights, tokenizer, chat template, compute dtype and KV bits,
so a changed model never reads another model's state.
"""

from __future__ import annotations

import logging

import mlx.core as mx

from ..cache import PrefixStore, StateCache, fingerprint, make_cache
from ..cache.store import KVLayout
from ..errors import CacheError
from ..memory import ModelFootprint
from ..models import LoadedModel
from ..models.dtype import dtype_name
from ..models.footprint import KV_GROUP_SIZE
from ..paths import cache_dir

log = logging.getLogger(__name__)


def prefix_store_for(
    loaded: LoadedModel, footprint: ModelFootprint, kv_bits: int | None, context_tokens: int
) -> PrefixStore | None:
    """The model's store, or None (with a warning) when its files cannot be fingerprinted: it still answers."""
    if not loaded.tokenizer:
        return None
    kinds = loaded.model.cache_kinds
    try:
        layout = KVLayout.of(
            len(kinds), footprint.kv_heads, footprint.head_dim, loaded.compute_dtype, context_tokens,
            kv_bits=kv_bits, group_size=KV_GROUP_SIZE, kinds=kinds, states=_state_slots(loaded, kv_bits),
        )  # fmt: skip
        model_fingerprint = _fingerprint(loaded, kv_bits)
    except CacheError as e:
        log.warning("not using warmed prefixes: %s", e)
        return None
    except OSError as e:
        log.warning("not using warmed prefixes: cannot fingerprint %s (%s)", loaded.path, e.strerror or e)
        return None
    return PrefixStore(cache_dir() / "prefixes", model_fingerprint, layout, label=loaded.path.name)


def _state_slots(loaded: LoadedModel, kv_bits: int | None) -> dict[int, tuple[mx.array | None, ...]]:
    """Each layer's arrays after one token: a recurrent layer's state (every snapshot of it has these shapes
    and dtypes), an attention layer's keys and values (their widths; nothing is computed for those)."""
    model = loaded.model
    caches = make_cache(model.cache_kinds, kv_bits)
    try:
        model.hidden(mx.array([[0]], dtype=mx.uint32), caches)  # a state's size does not grow with the input
        return {i: c.snapshot() if isinstance(c, StateCache) else c.state for i, c in enumerate(caches)}
    except (RuntimeError, ValueError) as e:  # what MLX raises for an op it cannot run here
        raise CacheError(f"{loaded.path}: cannot run a token to learn its caches' shapes ({e})") from None


def _fingerprint(loaded: LoadedModel, kv_bits: int | None) -> str:
    path, tokenizer = loaded.path, loaded.tokenizer
    files = [path] if path.is_file() else [*path.glob("*.safetensors"), path / "config.json"]
    settings = [dtype_name(loaded.compute_dtype), f"kv{kv_bits or 16}"]
    return fingerprint(files, tokenizer.backend.to_str(), tokenizer.chat_template or "", *settings)
