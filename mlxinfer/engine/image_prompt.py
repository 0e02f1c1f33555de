"""A prompt with images, from the caller's messages (or raw text and a list of images) to ids and PromptImages.

The order of the work bounds it: each image's header is read first (its size decides how many tokens it takes:
SmolVLM tiles by size, Gemma 3 always takes 256), the prompt is rendered and tokenized, checked against the context
and the image limits, and only then are the images decoded, resized, hashed and run through the tower (on a device
thread, one request's frames at a time). All of it runs for the caller (the server's preparing pool), never on the
scheduler's thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from ..cache import PrefixCache
from ..chat import IMAGE_PARTS, image_source
from ..errors import ImageError, SamplingError
from ..models.vision import VisionModel, check_images
from ..tokenizer import Tokenizer
from ..vision import DEFAULT_LIMITS, Limits, Opened, check_count, open_images
from ..vision.fetch import fetch_image
from .images import PromptImages
from .threads import call_on_device_thread

Message = dict[str, Any]


def split_images(messages: Sequence[Message]) -> tuple[list[Message], list[tuple[str, Any]]]:
    """The messages as a chat template reads them (each image part as {"type": "image"}), and the images'
    (where, source) in prompt order. Messages without image parts pass as they are."""
    out: list[Message] = []
    sources: list[tuple[str, Any]] = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list) or not any(_is_image(p) for p in content):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            if _is_image(part):
                sources.append((f"messages[{i}].content[{j}]", image_source(part)))
                parts.append({"type": "image"})
            else:
                parts.append(part)
        out.append({**message, "content": parts})
    return out, sources


@dataclass(frozen=True)
class RequestSources:
    """Where the images of a request that came over HTTP may come from, beyond data: URLs."""

    paths: bool = False  # files on this machine: for the user's own front ends (they show the server's token)
    urls: bool = False  # http(s) addresses, fetched with bounds (mlxinfer serve --image-urls)


def encode_chat(
    tokenizer: Tokenizer,
    vision: VisionModel | None,
    messages: Sequence[Message],
    context: int,
    limits: Limits = DEFAULT_LIMITS,
    tools: list[dict[str, Any]] | None = None,
    remote: RequestSources | None = None,
    add_generation_prompt: bool = True,
    variables: dict[str, Any] | None = None,
    prefix: PrefixCache | None = None,
) -> tuple[list[int], PromptImages | None]:
    """Ids of a chat and its images. `remote`: the messages came over HTTP, their images taken as it allows
    (None: the Python API's caller, whose paths, bytes and arrays are all taken); `variables`: more names for the
    template (enable_thinking, ...); `prefix`: the cache the request will resume from (its images' tokens held
    there, in memory or on disk, need no tower)."""
    rendered, sources = split_images(messages)
    if not sources:
        return tokenizer.encode_chat(messages, add_generation_prompt, tools, variables=variables), None
    vision = _reading(vision, len(sources))
    if remote is not None:
        sources = _requested(sources, remote, limits)
    opened = open_images(sources, limits)
    expansions = _expansions(vision, opened)
    placing = (vision.format.placeholder, expansions)
    ids = tokenizer.encode_chat(rendered, add_generation_prompt, tools, images=placing, variables=variables)
    return ids, _placed(ids, opened, vision, context, prefix)


def encode_text(
    tokenizer: Tokenizer, vision: VisionModel | None, text: str, images: Sequence[Any], context: int,
    limits: Limits = DEFAULT_LIMITS, prefix: PrefixCache | None = None,
) -> tuple[list[int], PromptImages | None]:  # fmt: skip
    """Ids of a raw prompt and its images: at each placeholder (Gemma 3's <start_of_image>) in `text`, else all
    before it (`prefix` as in encode_chat)."""
    if not images:
        return tokenizer.encode(text), None
    vision = _reading(vision, len(images))
    placeholder = vision.format.placeholder
    if placeholder not in text:
        text = placeholder * len(images) + text
    elif text.count(placeholder) != len(images):
        raise ImageError(f"the prompt has {text.count(placeholder)} {placeholder} but {len(images)} images were given")
    opened = open_images([(f"images[{i}]", s) for i, s in enumerate(images)], limits)
    ids = tokenizer.encode_images(text, placeholder, _expansions(vision, opened))
    return ids, _placed(ids, opened, vision, context, prefix)


def _reading(vision: VisionModel | None, count: int) -> VisionModel:
    check_images(count, vision, "this model")
    assert vision is not None
    return vision


def _expansions(vision: VisionModel, opened: list[Opened]) -> list[str]:
    """Each image's tokens as text, from its size alone (its header's)."""
    return [vision.format.expansion(vision.processor.layout(*image.size)) for image in opened]


def _placed(
    ids: Sequence[int], opened: list[Opened], vision: VisionModel, context: int, prefix: PrefixCache | None
) -> PromptImages:
    """The images decoded and placed at their tokens in `ids`, once the prompt is known to fit the context and to
    hold one run of image tokens per frame; the frames the prefix cache does not hold already go through the
    tower now."""
    if len(ids) > context:
        raise SamplingError(
            f"the prompt has {len(ids)} tokens with its images; the model's context is {context}; "
            "send fewer images or a shorter prompt"
        )
    layouts = [vision.processor.layout(*image.size) for image in opened]
    PromptImages.check_runs(ids, layouts, vision.format)  # before any pixel is read
    images = PromptImages.locate(ids, [vision.processor.frames(image.rgb()) for image in opened], layouts, vision)
    # A hint read off the scheduler's thread: an entry evicted meanwhile has its frames embedded in the prefill.
    resumable = prefix.resumable_tokens(images.cache_ids(ids)[:-1]) if prefix is not None else 0
    call_on_device_thread(partial(images.embed_ahead, resumable), "mlxinfer-tower")  # here, not in a scheduler step
    return images


def _requested(sources: list[tuple[str, Any]], allowed: RequestSources, limits: Limits) -> list[tuple[str, Any]]:
    """A request's image sources as they may be read: data: URLs; paths and web addresses only where allowed, the
    addresses fetched here: no more images than the limit, and together no more than its fetched bytes."""
    check_count(len(sources), limits)  # before anything is fetched
    out, left = [], limits.max_fetched_bytes
    for where, source in sources:
        text = source if isinstance(source, str) else ""
        if text.lower().startswith(("http://", "https://")):
            if not allowed.urls:
                raise ImageError(
                    f"{where}: image URLs are not fetched; send the image as a data: URL (base64), or start the "
                    "server with --image-urls"
                )
            data = fetch_image(text, where, min(limits.max_bytes, left))
            left -= len(data)
            out.append((where, data))
        elif text.startswith("data:") or (text and allowed.paths):
            out.append((where, text))
        else:
            raise ImageError(f"{where}: an image must be a data: URL (data:image/png;base64,...)")
    return out


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in IMAGE_PARTS
