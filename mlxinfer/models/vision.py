"""A vision-language model's image half: its tower and projector, how its prompts hold an image, its processor.

The family file (families/<text model_type>.py) builds it from a `VISION` entry keyed by the wrapper's model_type;
the loader attaches it to the LoadedModel. The engine asks it for an image's embeddings (`features`), which take
the places of the image's tokens in the prompt; the last few images' embeddings are kept by content hash, so a
second question about the same picture does not run the tower again even when the prefix cache lost it. A request's
frames are embedded ahead, while it is prepared (`embed_ahead`, on a device thread of its own); a frame the
scheduler still has to embed runs one at a time (engine/images.py ends a prefill chunk after each frame it must
embed), so no prefill step holds the scheduler for more than one frame's tower.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import ConfigError, ImageError, WeightMismatchError
from ..untrusted import shown_path
from ..vision import PREPROCESSOR_FILE, Layout, Processor, processor_from_folder
from .checkpoint import load_tensors
from .multimodal import Wrapper, wrapper_of
from .quantized import quantize_like
from .registry import family_module

if TYPE_CHECKING:
    from .checkpoint import Checkpoint

log = logging.getLogger(__name__)

MAX_FRAME_TOKENS = 16_384  # tokens one frame may take (Gemma 3: 256, SmolVLM: 64, Mistral 3: up to 3,025)
KEPT_FRAMES = 32  # frames whose embeddings stay in memory (a 256-token Gemma 3 frame is 2.5 MB at hidden 2560)
KEPT_BYTES = 256 << 20  # and their bytes together (a 1,024-token Qwen3-VL frame with deepstack is 32 MiB)


@dataclass(frozen=True)
class ImageFormat:
    """How one family's prompt holds an image: one run of image tokens per frame (tile) of it."""

    placeholder: str  # what its chat template writes for an image part ("<start_of_image>", "<image>")
    image_token_id: int  # the token whose places the frames' embeddings take
    tokens_per_frame: int
    bidirectional: bool  # a frame's tokens attend to each other both ways (Gemma 3), else causally
    # The text each placeholder becomes before tokenizing, for an image cut into Layout (rows, cols): the image
    # tokens and their markers (Gemma3Processor's full_image_sequence, SmolVLM's get_image_prompt_string).
    expansion: Callable[[Layout], str]
    # Where an image's frames are not each one run of tokens_per_frame (Pixtral ends each row of tokens with
    # [IMG_BREAK]; Qwen's and LFM2-VL's frames take tokens by their size): the lengths of each frame's runs, for its
    # Layout. None: every frame is one run of tokens_per_frame.
    frame_runs: Callable[[Layout], list[tuple[int, ...]]] | None = None
    # Where `bidirectional` holds only in some layer types (Gemma 4: its sliding layers), those; None: in all.
    bidirectional_in: tuple[str, ...] | None = None
    # An image's tokens take (time, row, column) positions from where it starts, and the text after it goes on from
    # there plus the longer side of its Layout.grid (Qwen's M-RoPE, models/shared_layers.py); else one position a token.
    grid_positions: bool = False

    def runs(self, layout: Layout) -> list[tuple[int, ...]]:
        """The run lengths of each frame of an image cut as `layout`."""
        if self.frame_runs is not None:
            return self.frame_runs(layout)
        return [(self.tokens_per_frame,)] * layout.frames

    def __post_init__(self) -> None:
        # Bounds the prompt text an image expands to before any context check can (a config states it).
        if not 1 <= self.tokens_per_frame <= MAX_FRAME_TOKENS:
            raise ConfigError(
                f"config.json: an image frame of {self.tokens_per_frame} tokens; at most {MAX_FRAME_TOKENS} are read"
            )


class VisionModel(nn.Module):
    """pixel_values (frames, 3, H, W) -> embeddings (frames, tokens_per_frame, text hidden) in the compute dtype."""

    format: ImageFormat
    processor: Processor
    # `convert` keeps the image half (convert/vision_half.py) only where mlx-lm can still load the output's text
    # model (it has a module for the wrapper, as for Gemma 3); others convert to their text model alone.
    converts_whole = False
    # Text layers after which the image tokens' hidden states get more of the tower's features (Qwen3-VL's
    # deepstack): the embeddings then hold, after each token's own, one more hidden-wide set per such layer.
    deep_layers = 0

    def __init__(self) -> None:
        super().__init__()
        self._kept: OrderedDict[tuple[bytes, int], mx.array] = OrderedDict()
        self._lock = threading.Lock()
        self._ahead = threading.Lock()  # one request's frames embedded ahead at a time (bounds their activations)

    def features(self, key: tuple[bytes, int], frame: np.ndarray) -> mx.array:
        """One frame's embeddings (tokens_per_frame, hidden), `key` its image's content hash and its index: from
        the last KEPT_FRAMES (at most KEPT_BYTES) or computed now (lazily: evaluated with the prefill chunk that
        places them)."""
        with self._lock:
            kept = self._kept.get(key)
            if kept is not None:
                self._kept.move_to_end(key)
                return kept
        out = self(mx.array(frame[None]))[0]
        with self._lock:
            self._kept[key] = out
            while len(self._kept) > 1 and (
                len(self._kept) > KEPT_FRAMES or sum(v.nbytes for v in self._kept.values()) > KEPT_BYTES
            ):
                self._kept.popitem(last=False)
        return out

    def embed_ahead(self, frames: list[tuple[tuple[bytes, int], np.ndarray]]) -> None:
        """Each frame's embeddings computed and kept now, on the calling thread (a request's preparation, never the
        scheduler's): its prefill then finds them kept, and no scheduler step waits on the tower. A frame evicted
        before its prefill (more than KEPT_FRAMES or KEPT_BYTES of them) is computed there instead, as before."""
        with self._ahead:
            for key, frame in frames:
                if not self.has(key):
                    mx.eval(self.features(key, frame))

    def fitted(self, processor: Processor) -> Processor:
        """The folder's image processor as this model reads images (Mistral 3 sizes them by merged patches)."""
        return processor

    def has(self, key: tuple[bytes, int]) -> bool:
        """Whether a frame's embeddings are kept (its tower run is done)."""
        with self._lock:
            return key in self._kept

    def activation_bytes(self, frames: int) -> int:
        """The most running `frames` frames together holds beyond the weights (the planner counts it)."""
        return 0

    def exported(self, name: str) -> str:
        """A parameter's name in mlx-vlm's layout of the family (what a conversion writes)."""
        return name

    @property
    def nbytes(self) -> int:
        from mlx.utils import tree_flatten

        return sum(v.nbytes for _, v in tree_flatten(self.parameters()))


# builder(config.json, the tower's and projector's tensors under their stored names, the compute dtype, the source
# to name in errors) -> a VisionModel holding those weights (the family file's VISION[model_type]).
Builder = Callable[[dict[str, Any], dict[str, mx.array], mx.Dtype, str], VisionModel]


def vision_builder(wrapper: Wrapper, model_type: str) -> Builder | None:
    """The family file's builder for a vision-language model_type, None where images are not supported yet."""
    module = importlib.import_module(family_module(wrapper.text_type))
    return getattr(module, "VISION", {}).get(model_type)


def load_vision(checkpoint: Checkpoint, dtype: mx.Dtype, source: str) -> VisionModel | None:
    """The vision half of a vision-language checkpoint, weights loaded; None for a text model or a family whose
    images are not supported yet (the text model then runs alone, as models/multimodal.py logs)."""
    model = build_vision(checkpoint, dtype, source)
    if model is not None:
        mx.eval(model.parameters())
        model.eval()
    return model


def build_vision(checkpoint: Checkpoint, dtype: mx.Dtype, source: str) -> VisionModel | None:
    """load_vision's model with its weights still lazy (mapped from the files, read when evaluated): what the
    converter writes out tensor by tensor."""
    wrapper = wrapper_of(checkpoint.config)
    if wrapper is None or "vision_config" not in checkpoint.config:
        return None
    build = vision_builder(wrapper, checkpoint.config["model_type"])
    if build is None:
        return None
    names = {n: n for n in checkpoint.tensors if n.startswith(wrapper.vision_prefixes)}
    if not names:  # a text model saved under the wrapper's name (a converted language model alone)
        return None
    if not (checkpoint.folder / PREPROCESSOR_FILE).is_file():
        log.warning("%s: %s is missing, so images cannot be read", shown_path(checkpoint.folder), PREPROCESSOR_FILE)
        return None
    model = build(checkpoint.config, load_tensors(replace(checkpoint, stored_names=names)), dtype, source)
    model.processor = model.fitted(processor_from_folder(checkpoint.folder))
    return model


def load_checked(
    model: VisionModel, weights: dict[str, mx.array], dtype: mx.Dtype, source: str, mode: str = "affine"
) -> None:
    """`weights` into `model`, floats cast to `dtype`; layers stored quantized (an mlx-vlm conversion's) are
    quantized alike first. WeightMismatchError naming what differs (names or shapes)."""
    quantize_like(model, weights, mode=mode, dtype=dtype)
    cast = [(k, v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v) for k, v in weights.items()]
    try:
        model.load_weights(cast, strict=True)
    except ValueError as e:
        raise WeightMismatchError(f"{source}: the vision tower's weights do not match its config ({e})") from None


def check_images(count: int, vision: VisionModel | None, source: str) -> None:
    """An ImageError for images given to a model that cannot read them."""
    if count and vision is None:
        raise ImageError(f"{source} does not read images (no vision tower loaded); send text only")
