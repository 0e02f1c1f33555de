"""Images in a prompt: where each one's tokens sit, what the prefix cache calls them, and their embeddings per chunk.

An image's tokens are all the same id (Gemma 3's <image_soft_token>), so two pictures would look alike to a cache
keyed by token ids. The cache therefore sees `cache_ids`: the prompt with each image token replaced by a negative
key drawn from the image's content hash and its place in the image, which no vocabulary id can equal. Two
different images part at their first token; the same image asked about again is the same key sequence, so its
KV (and everything before the question) is reused, in memory and on disk alike.

A prefill chunk never cuts an image's frame (its tokens may attend to each other both ways, so they run together),
never snapshots inside one, and never resumes inside one. An image cut into tiles (SmolVLM) is a run of tokens per
tile; a chunk ends after the first frame whose embeddings must be computed, so each prefill step runs the tower
over one frame at most.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..errors import ImageError
from ..models.vision import ImageFormat, VisionModel
from ..vision import digest

_KEYS = (1 << 31) - 1  # keys are -1 .. -(2**31 - 1): int32, as prefix files store token ids


@dataclass(frozen=True)
class ImageSpan:
    """One frame (tile) of an image in a prompt: its first token's position, its token count, which image and frame
    it is, and the image's content hash."""

    start: int
    length: int
    image: int
    frame: int
    digest: bytes

    @property
    def end(self) -> int:
        return self.start + self.length

    def keys(self) -> list[int]:
        """What the prefix cache calls this frame's tokens."""
        return [-1 - _key(self.digest, self.frame, i) for i in range(self.length)]


@dataclass(frozen=True)
class PromptImages:
    """The images of one prompt (a run of tokens per frame of each) and the vision model that embeds them."""

    spans: tuple[ImageSpan, ...]
    frames: tuple[np.ndarray, ...]  # each image's pixel_values, (frames, 3, H, W) float32
    digests: tuple[bytes, ...]
    vision: VisionModel

    @staticmethod
    def check_runs(ids: Sequence[int], frames: Sequence[int], fmt: ImageFormat) -> list[tuple[int, int]]:
        """(start, length) of each frame's tokens in `ids`, for images of `frames` frames each; ImageError unless
        there is exactly one run of tokens_per_frame image tokens per frame."""
        runs = _runs(ids, fmt.image_token_id)
        if len(runs) != sum(frames) or any(length != fmt.tokens_per_frame for _, length in runs):
            raise ImageError(
                f"the prompt places {len(runs)} image frames ({sum(n for _, n in runs)} image tokens) but the "
                f"{len(frames)} images given need {sum(frames)} of {fmt.tokens_per_frame} tokens each; put one "
                f"{fmt.placeholder} per image"
            )
        return runs

    @classmethod
    def locate(cls, ids: Sequence[int], images: Sequence[np.ndarray], vision: VisionModel) -> PromptImages:
        """The images (each's pixel_values, (frames, 3, H, W)) at their frames' runs in `ids`, in order."""
        runs = iter(cls.check_runs(ids, [len(f) for f in images], vision.format))
        digests = tuple(digest(f) for f in images)
        spans = tuple(
            ImageSpan(*next(runs), image, frame, digests[image])
            for image, frames in enumerate(images)
            for frame in range(len(frames))
        )
        return cls(spans, tuple(images), digests, vision)

    @property
    def activation_bytes(self) -> int:
        """What running the tower may hold at once beyond the weights: one frame's (chunk_end gives each step at
        most one frame to embed)."""
        return self.vision.activation_bytes(1)

    def cache_ids(self, ids: Sequence[int]) -> list[int]:
        """`ids` as the prefix cache keys them: each image's tokens by the image's content."""
        out = list(ids)
        for span in self.spans:
            out[span.start : span.end] = span.keys()
        return out

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
        features = [
            (s.start - start, self.vision.features(_frame_key(s), self.frames[s.image][s.frame])) for s in spans
        ]
        blocks = [(s.start, s.end) for s in spans] if self.vision.format.bidirectional else []
        return Placed(features, blocks)


@dataclass(frozen=True)
class Placed:
    """The images of one prefill chunk: embeddings at chunk offsets, and the blocks that attend both ways."""

    features: list[tuple[int, mx.array]]
    blocks: list[tuple[int, int]]

    def place(self, h: mx.array) -> mx.array:
        """`h` (1, chunk, hidden) with each image's embeddings in its tokens' places."""
        parts, at = [], 0
        for offset, rows in self.features:
            parts += [h[:, at:offset], rows[None].astype(h.dtype)]
            at = offset + rows.shape[0]
        return mx.concatenate([*parts, h[:, at:]], axis=1)


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
