"""A generation request as the Python API states it, and the checks every request passes.

The request runs through the one generation loop (engine/loop.py), alone on the
caller's thread (engine/single.py) or batched with others (engine/serving.py);
the loop's admission (engine/admission.py) checks it with `check_request`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ..adapters import NO_ADAPTER, Chosen
from ..defaults import DEFAULT_MAX_TOKENS, MAX_TOKENS, PREFILL_CHUNK_TOKENS
from ..errors import SamplingError
from ..grammar import Constraint
from ..untrusted import shown
from .images import PromptImages
from .prefill import SNAPSHOT_EVERY
from .sampling import SamplingParams


@dataclass
class GenerationRequest:
    """Everything that decides which tokens come out."""

    prompt_ids: Sequence[int]
    max_tokens: int = DEFAULT_MAX_TOKENS
    sampling: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: Iterable[int] = ()
    prefill_chunk_tokens: int = PREFILL_CHUNK_TOKENS
    kv_bits: int | None = None  # 8 or 4: keys and values stored quantized
    snapshot_every: int = SNAPSHOT_EVERY  # tokens between state snapshots (models with uncuttable layers)
    constraint: Constraint | None = None  # structured output: only tokens its grammar allows are drawn
    speculate: str = "off"  # speculative decoding: "auto", "off", "lookup" or "draft" (engine/speculation.py)
    images: PromptImages | None = None  # the prompt's images at their tokens' places (engine/image_prompt.py)
    adapter: Chosen = NO_ADAPTER  # the fine-tune it runs with (adapters/rows.py; Model.adapters)


def check_options(request: GenerationRequest) -> None:
    """A SamplingError unless the request's own sizes are positive integers."""
    for name in ("prefill_chunk_tokens", "snapshot_every"):
        value = getattr(request, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise SamplingError(f"{name} must be a positive integer, got {shown(value)}")


def check_request(prompt_ids: Sequence[int], max_tokens: object, vocab_size: int) -> None:
    """A SamplingError unless the prompt is non-empty ids of this vocabulary and max_tokens is sane."""
    if not prompt_ids:
        raise SamplingError("the prompt is empty; give at least one token")
    low, high = min(prompt_ids), max(prompt_ids)
    if low < 0 or high >= vocab_size:
        # An id past the embedding table would read out of bounds on the device.
        raise SamplingError(
            f"prompt token id {high if high >= vocab_size else low} is outside the model's vocabulary "
            f"[0, {vocab_size}); the tokenizer does not match the weights"
        )
    check_max_tokens(max_tokens)


def check_max_tokens(max_tokens: object) -> None:
    """A SamplingError unless max_tokens is an integer in [1, MAX_TOKENS] (the CLI checks its flag with this)."""
    if not isinstance(max_tokens, int) or not 1 <= max_tokens <= MAX_TOKENS:
        raise SamplingError(f"max_tokens must be an integer in [1, {MAX_TOKENS}], got {shown(max_tokens)}")
