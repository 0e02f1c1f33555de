"""Prefill and decode: prompt ids in, generated ids out, as a generator.

Stages, each small: `prefill` runs the prompt through the model in chunks (an
`mx.eval` between chunks bounds activation memory) and returns the last
position's logits; `decode` samples a token, queues the next step on the device
before handing the current token to the caller, and stops on EOS or max_tokens.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from ..cache import Cache, PrefixCache, Snapshot, held_positions, make_cache
from ..errors import SamplingError
from ..models.decoder import DecoderLM
from ..untrusted import shown
from .prefill import DEFAULT_PREFILL_CHUNK_TOKENS, SNAPSHOT_EVERY, Prefill, message_ends
from .sampling import Sampler, SamplingParams
from .stats import GenerationStats

MAX_TOKENS = 1_000_000  # tokens one request may ask for


@dataclass
class GenerationRequest:
    """Everything that decides which tokens come out."""

    prompt_ids: Sequence[int]
    max_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: Iterable[int] = ()
    prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS
    kv_bits: int | None = None  # 8 or 4: keys and values stored quantized
    snapshot_every: int = SNAPSHOT_EVERY  # tokens between state snapshots (models with uncuttable layers)


def prefill(model: DecoderLM, prompt: mx.array, cache: list[Cache], chunk_tokens: int) -> mx.array:
    """Run `prompt` (1-D ids) into `cache`; returns logits of its last position, shape (vocab,)."""
    return Prefill.start(model, cache, prompt, chunk_tokens).run()


def decode(model: DecoderLM, first_logits: mx.array, cache: list[Cache], sampler: Sampler) -> Iterator[int]:
    """Yield sampled tokens forever; the caller decides when to stop."""
    token = sampler(first_logits)
    mx.async_eval(token)
    while True:
        logits = model(token.reshape(1, 1), cache)[0, -1]
        next_token = sampler(logits)
        mx.async_eval(next_token)  # the device works on step n+1 while the caller handles step n
        yield int(token.item())
        token = next_token


def generate_ids(
    model: DecoderLM, request: GenerationRequest, stats: GenerationStats, prefix_cache: PrefixCache | None = None
) -> Iterator[int]:
    """Generated ids for `request`, filling `stats` as it goes (EOS itself is not yielded).

    With a `prefix_cache`, the longest cached prefix of the prompt is reused and
    only the rest is prefilled; when the generation ends (or is closed early, or
    stopped by Ctrl-C) the prompt and the tokens fed back while decoding, as far
    as every layer holds them, are offered to the cache.
    """
    check_request(request.prompt_ids, request.max_tokens, model.model.embed_tokens.weight.shape[0])
    for name in ("prefill_chunk_tokens", "snapshot_every"):
        value = getattr(request, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise SamplingError(f"{name} must be a positive integer, got {shown(value)}")
    prompt_ids = list(request.prompt_ids)
    cache = make_cache(model.cache_kinds, request.kv_bits)
    drawn: list[int] = []  # every token decode() produced, each of them already fed into `cache`
    snapshots: dict[int, Snapshot] = {}  # state snapshots taken while prefilling (or inherited from the hit)
    hit, sound = None, False
    try:
        hit = prefix_cache.lookup(prompt_ids) if prefix_cache is not None else None
        if hit:
            hit.restore(cache)
            snapshots.update(hit.snapshots)
        stats.cached_tokens = hit.tokens if hit else 0
        stats.diverged_at = hit.diverged_at if hit else None
        stats.cache_note = hit.reason if hit else ""
        yield from _generate(model, request, stats, cache, drawn, snapshots)
        sound = True
    except GeneratorExit:
        sound = True  # the caller stopped reading (a stop string, a closed stream): the cache is sound
        raise
    except KeyboardInterrupt:
        # Ctrl-C is raised between two bytecodes, never by a failed computation: whatever the
        # layers hold is sound, even mid-forward (held_positions keeps what every layer has).
        # Errors from the device are not kept: their graph might fail again in the next request.
        sound, stats.finish_reason = True, "cancelled"
        raise
    finally:
        if prefix_cache is not None:
            prefix_cache.release(hit)
            if sound:  # the next turn of a chat starts with this prompt and answer
                prefix_cache.insert((prompt_ids + drawn)[: held_positions(cache)], cache, snapshots=snapshots)


def _generate(
    model: DecoderLM,
    request: GenerationRequest,
    stats: GenerationStats,
    cache: list[Cache],
    drawn: list[int],
    snapshots: dict[int, Snapshot],
) -> Iterator[int]:
    eos = set(request.eos_token_ids)
    prompt = mx.array(list(request.prompt_ids), dtype=mx.uint32)
    sampler = Sampler(request.sampling, vocab_size=model.model.embed_tokens.weight.shape[0])
    sampler.observe(prompt)
    cached = cache[0].length
    mx.reset_peak_memory()
    start = time.perf_counter()
    stats.prompt_tokens = prompt.size
    stats.prefilled_tokens = prompt.size - cached
    stats.finish_reason = "length"
    run = Prefill.start(model, cache, prompt[cached:], request.prefill_chunk_tokens, request.snapshot_every,
                        message_ends(request.prompt_ids, eos), inherited=snapshots)  # fmt: skip
    try:
        first_logits = run.run()
    finally:  # a prefill stopped by Ctrl-C keeps the snapshots it took
        snapshots.update(run.snapshots)
    first_at = None
    for count, token in enumerate(decode(model, first_logits, cache, sampler)):
        drawn.append(token)
        now = time.perf_counter()
        if first_at is None:
            first_at = now
            stats.first_token(now - start, now - start)
        elif count > 0:
            stats.decoded(count, now - first_at)
        stats.total_s = now - start
        stats.peak_memory_bytes = mx.get_peak_memory()
        if token in eos:
            stats.finish_reason = "stop"
            return
        stats.generated_tokens = count + 1
        yield token
        if count + 1 >= request.max_tokens:
            return


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
