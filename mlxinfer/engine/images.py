"""Images in a prompt: where each one's tokens sit, what the prefix cache calls them, and their embeddings per chunk.

An image's tokens are all the same id (Gemma 3's <image_soft_token>), so two pictures would look alike to a cache
keyed by token ids. The cache therefore sees `cache_ids`: the prompt with each image token replaced by a negative
key drawn from the image's content hash and its place in the image, which no vocabulary id can equal. Two
different images part at their first token; the same image asked about again is the same key sequence, so its
KV (and everything before the question) is reused, in memory and on disk alike.

A prefill chunk never cuts an image's frame (its tokens may attend to each other both ways, so they run together),
never snapshots inside one, and never resumes inside one. An image cut into tiles (SmolVLM) is a run of tokens per
tile; Pixtral's frame is a run a row of tokens, each ended by an [IMG_BREAK] that stays text. A chunk ends after the
first frame whose embeddings must be computed, so each prefill step runs the tower over one frame at most.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..errors import ImageError
from ..models.vision import ImageFormat, VisionModel
from ..vision import Layout, digest

_KEYS = (1 << 31) - 1  # keys are -1 .. -(2**31 - 1): int32, as prefix files store token ids


@dataclass(frozen=True)
class ImageSpan:
    """One frame (tile) of an image in a prompt: the runs of its image tokens, (start, length) each (one run, unless
    markers part its rows as Pixtral's [IMG_BREAK] do), which image and frame it is, and the image's content hash."""

    runs: tuple[tuple[int, int], ...]
    image: int
    frame: int
    digest: bytes
    grid: tuple[int, int] | None = None  # its (rows, cols) of tokens, where the processor sizes it by content

    @property
    def saved(self) -> int:
        """What M-RoPE moves the text after this frame back by: its tokens less its longer side."""
        assert self.grid is not None, "M-RoPE needs each image's grid of tokens"
        rows, cols = self.grid
        return rows * cols - max(rows, cols)

    @property
    def start(self) -> int:
        return self.runs[0][0]

    @property
    def end(self) -> int:
        return self.runs[-1][0] + self.runs[-1][1]

    def keys(self) -> list[int]:
        """What the prefix cache calls this frame's image tokens, in order."""
        return [-1 - _key(self.digest, self.frame, i) for i in range(sum(n for _, n in self.runs))]


@dataclass(frozen=True)
class PromptImages:
    """The images of one prompt (runs of tokens per frame of each) and the vision model that embeds them."""

    spans: tuple[ImageSpan, ...]
    frames: tuple[np.ndarray, ...]  # each image's pixel_values, (frames, 3, H, W) float32
    digests: tuple[bytes, ...]
    vision: VisionModel

    @staticmethod
    def check_runs(ids: Sequence[int], layouts: Sequence[Layout], fmt: ImageFormat) -> list[list[tuple[int, int]]]:
        """Each frame's runs of image tokens in `ids` ((start, length) each), frames in order, for images cut as
        `layouts`; ImageError unless the runs are exactly those the images need."""
        needed = [frame for layout in layouts for frame in fmt.runs(layout)]
        runs = _runs(ids, fmt.image_token_id)
        if [n for _, n in runs] != [n for frame in needed for n in frame]:
            raise ImageError(
                f"the prompt places {sum(n for _, n in runs)} image tokens in {len(runs)} runs but the "
                f"{len(layouts)} images given need {sum(map(sum, needed))} in {sum(map(len, needed))}; put one "
                f"{fmt.placeholder} per image"
            )
        found = iter(runs)
        return [[next(found) for _ in frame] for frame in needed]

    @classmethod
    def locate(cls, ids: Sequence[int], images: Sequence[np.ndarray], layouts: Sequence[Layout],
               vision: VisionModel) -> PromptImages:  # fmt: skip
        """The images (each's pixel_values, (frames, 3, H, W), cut as its layout) at their frames' runs in `ids`."""
        frames = iter(cls.check_runs(ids, layouts, vision.format))
        digests = tuple(digest(f) for f in images)
        spans = tuple(
            ImageSpan(tuple(next(frames)), image, frame, digests[image], layouts[image].grid)
            for image, pixels in enumerate(images)
            for frame in range(len(pixels))
        )
        return cls(spans, tuple(images), digests, vision)

    def embed_ahead(self, resumable: int = 0) -> None:
        """The embeddings of every frame that ends past the first `resumable` tokens (those before are resumed from
        the prefix cache, KV and all), computed now and kept (models/vision.VisionModel.embed_ahead)."""
        needed = [s for s in self.spans if s.end > resumable]
        self.vision.embed_ahead([(_frame_key(s), self.frames[s.image][s.frame]) for s in needed])

    @property
    def activation_bytes(self) -> int:
        """What running the tower may hold at once beyond the weights: one frame's (chunk_end gives each step at
        most one frame to embed)."""
        return self.vision.activation_bytes(1)

    def cache_ids(self, ids: Sequence[int]) -> list[int]:
        """`ids` as the prefix cache keys them: each image's tokens by the image's content."""
        out = list(ids)
        for span in self.spans:
            keys = iter(span.keys())
            for start, length in span.runs:
                out[start : start + length] = [next(keys) for _ in range(length)]
        return out

    def rope_shift(self, position: int) -> int:
        """How far M-RoPE puts the token at `position` (not inside an image) before its index: minus what the images
        before it saved. 0 for a model whose images take one position a token."""
        if not self.vision.format.grid_positions:
            return 0
        return -sum(span.saved for span in self.spans if span.end <= position)

    def positions(self, start: int, end: int) -> mx.array:
        """(3, end - start) M-RoPE positions of the prompt's tokens [start, end), which cut no image: text at its
        index less what the images before it saved (in all three), an image's tokens at (s, s + row, s + col) from
        the position s its first token takes."""
        out = np.broadcast_to(np.arange(start, end) + self.rope_shift(start), (3, end - start)).copy()
        for span in (s for s in self.spans if start <= s.start < end):
            at, (rows, cols) = span.start + self.rope_shift(span.start), span.grid or (0, 0)
            cell = np.arange(rows * cols)
            out[:, span.start - start : span.end - start] = [np.full(rows * cols, at), at + cell // cols,
                                                            at + cell % cols]  # fmt: skip
            out[:, span.end - start :] -= span.saved
        return mx.array(out)

    def inside(self, position: int) -> bool:
        """Whether `position` falls strictly within an image (a chunk may neither end nor resume there)."""
        return any(span.start < position < span.end for span in self.spans)

    def chunk_end(self, start: int, end: int) -> int:
        """Where a prefill chunk of positions [start, end) ends: past the frame it would cut, and right after the
        first frame whose tower has yet to run (one frame's tower a step: the scheduler's other requests wait
        no longer than that)."""
        end = next((span.end for span in self.spans if span.start < end < span.end), end)
        first = next((s for s in self.spans if start <= s.start < end and not self.vision.has(_frame_key(s))), None)
        return end if first is None else first.end

    def placed(self, start: int, end: int) -> Placed | None:
        """The image frames within the chunk of positions [start, end), None where it holds none."""
        spans = [s for s in self.spans if start <= s.start and s.end <= end]
        if not spans:
            return None
        features = []
        for s in spans:
            rows, at = self.vision.features(_frame_key(s), self.frames[s.image][s.frame]), 0
            for run_start, length in s.runs:
                features.append((run_start - start, rows[at : at + length]))
                at += length
        fmt = self.vision.format
        blocks = [(s.start, s.end) for s in spans] if fmt.bidirectional else []
        positions = self.positions(start, end) if fmt.grid_positions else None
        return Placed(features, blocks, fmt.bidirectional_in, positions, self.vision.deep_layers)


@dataclass(frozen=True)
class Placed:
    """The images of one prefill chunk: embeddings at chunk offsets, and the blocks that attend both ways."""

    features: list[tuple[int, mx.array]]
    blocks: list[tuple[int, int]]
    kinds: tuple[str, ...] | None = None  # the layer types the blocks hold in (None: all)
    positions: mx.array | None = None  # (3, chunk) M-RoPE positions (PromptImages.positions), for such models
    # Qwen3-VL's deepstack: each frame's embeddings hold, after the tokens' own, one more hidden-wide set per layer
    # to add after that layer (VisionModel.deep_layers).
    deep_layers: int = 0

    def blocks_for(self, kind: str) -> list[tuple[int, int]]:
        """The bidirectional blocks of a `kind` layer."""
        return self.blocks if self.kinds is None or kind in self.kinds else []

    def token_mask(self, length: int) -> mx.array:
        """(length,) bool: which of the chunk's tokens are images'."""
        at = mx.arange(length)
        mask = mx.zeros((length,), dtype=mx.bool_)
        for offset, rows in self.features:
            mask = mask | ((at >= offset) & (at < offset + rows.shape[0]))
        return mask

    def place(self, h: mx.array) -> mx.array:
        """`h` (1, chunk, hidden) with each image's embeddings in its tokens' places."""
        parts, at, width = [], 0, h.shape[-1]
        for offset, rows in self.features:
            parts += [h[:, at:offset], rows[None, :, :width].astype(h.dtype)]
            at = offset + rows.shape[0]
        return mx.concatenate([*parts, h[:, at:]], axis=1)

    def deepened(self, layer: int, h: mx.array) -> mx.array:
        """`h` (1, chunk, hidden) after layer `layer` (< deep_layers), each image's deepstack features for that layer
        added at its tokens (transformers' Qwen3VLTextModel._deepstack_process)."""
        parts, at, width = [], 0, h.shape[-1]
        low = width * (layer + 1)
        for offset, rows in self.features:
            parts += [mx.zeros((1, offset - at, width), h.dtype), rows[None, :, low : low + width].astype(h.dtype)]
            at = offset + rows.shape[0]
        return h + mx.concatenate([*parts, mx.zeros((1, h.shape[1] - at, width), h.dtype)], axis=1)


def _frame_key(span: ImageSpan) -> tuple[bytes, int]:
    return span.digest, span.frame


def _runs(ids: Sequence[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of each run of `token` in `ids`."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t != token:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def _key(digest: bytes, frame: int, index: int) -> int:
    named = digest + frame.to_bytes(4, "little") + index.to_bytes(4, "little")
    return int.from_bytes(hashlib.blake2b(named, digest_size=8).digest(), "little") % _KEYS
