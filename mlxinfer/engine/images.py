"""Images in a prompt: where each one's tokens sit, what the prefix cache calls them, and their embeddings per chunk.

An image's tokens are all the same id (Gemma 3's <image_soft_token>), so two pictures would look alike to a cache
keyed by token ids. The cache therefore sees `cache_ids`: the prompt with each image token replaced by a negative
key drawn from the image's content hash and its place in the image, which no vocabulary id can equal. Two
different images part at their first token; the same image asked about again is the same key sequence, so its
KV (and everything before the question) is reused, in memory and on disk alike.

A prefill chunk never cuts an image (its tokens may attend to each other both ways, so they run together), never
snapshots inside one, and never resumes inside one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..errors import ImageError
from ..models.vision import ImageFormat, VisionModel

_KEYS = (1 << 31) - 1  # keys are -1 .. -(2**31 - 1): int32, as prefix files store token ids


@dataclass(frozen=True)
class ImageSpan:
    """One image in a prompt: its first token's position, its token count, its content hash and pixels."""

    start: int
    length: int
    digest: bytes
    pixels: np.ndarray  # pixel_values (3, H, W), float32

    @property
    def end(self) -> int:
        return self.start + self.length

    def keys(self) -> list[int]:
        """What the prefix cache calls this image's tokens."""
        return [-1 - _key(self.digest, i) for i in range(self.length)]


@dataclass(frozen=True)
class PromptImages:
    """The images of one prompt and the vision model that embeds them."""

    spans: tuple[ImageSpan, ...]
    vision: VisionModel

    @staticmethod
    def check_runs(ids: Sequence[int], images: int, fmt: ImageFormat) -> list[tuple[int, int]]:
        """(start, length) of each image's tokens in `ids`; ImageError unless there is exactly one run of
        tokens_per_image image tokens per image."""
        runs = _runs(ids, fmt.image_token_id)
        if len(runs) != images or any(length != fmt.tokens_per_image for _, length in runs):
            raise ImageError(
                f"the prompt places {len(runs)} images ({sum(n for _, n in runs)} image tokens) but {images} "
                f"were given, {fmt.tokens_per_image} tokens each; put one {fmt.placeholder} per image"
            )
        return runs

    @classmethod
    def locate(
        cls, ids: Sequence[int], pixels: Sequence[tuple[bytes, np.ndarray]], vision: VisionModel
    ) -> PromptImages:
        """The images `pixels` ((digest, pixel_values) each, in prompt order) at their tokens' runs in `ids`."""
        runs = cls.check_runs(ids, len(pixels), vision.format)
        spans = tuple(ImageSpan(start, length, d, p) for (start, length), (d, p) in zip(runs, pixels))
        return cls(spans, vision)

    def cache_ids(self, ids: Sequence[int]) -> list[int]:
        """`ids` as the prefix cache keys them: each image's tokens by the image's content."""
        out = list(ids)
        for span in self.spans:
            out[span.start : span.end] = span.keys()
        return out

    def inside(self, position: int) -> bool:
        """Whether `position` falls strictly within an image (a chunk may neither end nor resume there)."""
        return any(span.start < position < span.end for span in self.spans)

    def chunk_end(self, end: int) -> int:
        """`end` moved past the image it would cut."""
        return next((span.end for span in self.spans if span.start < end < span.end), end)

    def placed(self, start: int, end: int) -> Placed | None:
        """The images within the chunk of positions [start, end), None where it holds none."""
        spans = [s for s in self.spans if start <= s.start and s.end <= end]
        if not spans:
            return None
        features = [(s.start - start, self.vision.features(s.digest, s.pixels)) for s in spans]
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


def _key(digest: bytes, index: int) -> int:
    return (
        int.from_bytes(hashlib.blake2b(digest + index.to_bytes(4, "little"), digest_size=8).digest(), "little") % _KEYS
    )
