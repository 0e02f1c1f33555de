"""Logits to the next token: repetition penalty, temperature, top-k, top-p, min-p.

The order follows transformers' logits processors. All work stays on the device
and lazy, so the decode loop can queue the next step before reading this one.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from ..defaults import DEFAULT_SAMPLING
from ..errors import SamplingError
from ..untrusted import is_finite_number, is_int, shown


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature 0 (or below 1e-5, where logits would overflow) is greedy.

    Example:
        >>> SamplingParams(temperature=0.7, top_p=0.9, seed=1)
    """

    temperature: float = DEFAULT_SAMPLING["temperature"]
    top_p: float = DEFAULT_SAMPLING["top_p"]
    top_k: int = DEFAULT_SAMPLING["top_k"]
    min_p: float = DEFAULT_SAMPLING["min_p"]
    repetition_penalty: float = DEFAULT_SAMPLING["repetition_penalty"]
    seed: int | None = None

    def __post_init__(self) -> None:
        _number("temperature", self.temperature, lo=0.0, hi=100.0)
        _number("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        _number("min_p", self.min_p, lo=0.0, hi=1.0)
        _number("repetition_penalty", self.repetition_penalty, lo=0.0, hi=100.0, lo_open=True)
        if not is_int(self.top_k) or self.top_k < 0:
            raise SamplingError(f"top_k must be an integer >= 0 (0 disables it), got {shown(self.top_k)}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise SamplingError(f"seed must be an integer in [0, 2**63), got {shown(self.seed)}")
        for name in ("top_k", "seed"):  # numpy integers in, plain ints stored
            if getattr(self, name) is not None:
                object.__setattr__(self, name, int(getattr(self, name)))

    @property
    def is_greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


MIN_TEMPERATURE = 1e-5


def with_defaults(given: Mapping[str, Any], stated: Mapping[str, Any]) -> SamplingParams:
    """A request's sampling: the fields it gives (None is "not given"), else those its model states
    (formats/recommended_sampling.py), else SamplingParams' own: greedy.

    Example:
        >>> with_defaults({"top_p": 0.5}, {"temperature": 0.7, "top_p": 0.8})
        SamplingParams(temperature=0.7, top_p=0.5, top_k=0, min_p=0.0, repetition_penalty=1.0, seed=None)
    """
    return SamplingParams(**{**stated, **{name: value for name, value in given.items() if value is not None}})


def _number(name: str, value: object, lo: float, hi: float, lo_open: bool = False) -> None:
    ok = is_finite_number(value)
    if ok:
        ok = (lo < value if lo_open else lo <= value) and value <= hi
    if not ok:
        bracket = "(" if lo_open else "["
        raise SamplingError(f"{name} must be a finite number in {bracket}{lo:g}, {hi:g}], got {shown(value)}")


class Sampler:
    """Stateful sampler for one generation: remembers seen tokens and its RNG key."""

    def __init__(self, params: SamplingParams, vocab_size: int):
        self.params = params
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._key = mx.random.key(seed)
        self._seen = mx.zeros((vocab_size,), dtype=mx.bool_) if params.repetition_penalty != 1.0 else None

    def observe(self, tokens: mx.array) -> None:
        """Record tokens (prompt or generated) for the repetition penalty."""
        if self._seen is not None:
            self._seen[tokens.reshape(-1)] = True

    def __call__(self, logits: mx.array, allowed: mx.array | None = None) -> mx.array:
        """Pick one token from logits of shape (vocab,), among the `allowed` ones (a boolean mask) if given;
        returns a uint32 scalar array."""
        p = self.params
        logits = logits.astype(mx.float32)
        if self._seen is not None:
            logits = self._penalize(logits, self._seen)
        if allowed is not None:  # before top-k/top-p: they choose among the tokens the grammar allows
            logits = mx.where(allowed, logits, mx.array(-math.inf, dtype=logits.dtype))
        if p.is_greedy:
            token = mx.argmax(logits, axis=-1)
        else:
            logits = filter_logits(logits / p.temperature, p.top_k, p.top_p, p.min_p)
            self._key, key = mx.random.split(self._key)
            token = mx.random.categorical(logits, key=key)
        token = token.astype(mx.uint32)
        self.observe(token)
        return token

    def verify(
        self,
        logits: mx.array,
        drafts: Sequence[int],
        draft_probs: mx.array | None = None,
        allowed: mx.array | None = None,
    ) -> list[int]:
        """Speculative decoding's check of `drafts` against the target's `logits` for them.

        `logits` has one row per draft plus one: row i is what the target predicts after
        drafts[:i] (`allowed` the grammar's mask there). Returns the tokens to emit: the
        drafts accepted, then one token of the target's own. Greedy: a draft is accepted
        while it is the argmax, so the output is plain greedy decoding's. Sampled:
        rejection sampling (Leviathan et al. 2023; Chen et al. 2023) against
        `draft_probs`, the distribution each draft was drawn from (None: each draft was
        certain, as prompt lookup's are), so every token follows the target's own
        distribution. Nothing is observed: the caller observes the tokens it keeps."""
        n = len(drafts)
        logits = self._penalized(logits.astype(mx.float32), drafts)
        if allowed is not None:
            logits = mx.where(allowed, logits, mx.array(-math.inf, dtype=logits.dtype))
        if self.params.is_greedy:
            best = mx.argmax(logits, axis=-1).tolist()
            accepted = next((i for i in range(n) if best[i] != drafts[i]), n)
            return [*drafts[:accepted], best[accepted]]
        p = self.params
        probs = mx.softmax(filter_logits(logits / p.temperature, p.top_k, p.top_p, p.min_p), axis=-1)
        rows, picked = mx.arange(n), mx.array(drafts, dtype=mx.int32)
        q = draft_probs if draft_probs is not None else _one_hot(picked, probs.shape[-1])
        self._key, uniform_key, residual_key, last_key = mx.random.split(self._key, 4)
        # Accept draft i with probability min(1, p(d_i) / q(d_i)).
        accept = mx.random.uniform(shape=(n,), key=uniform_key) * q[rows, picked] < probs[rows, picked]
        # Where draft i is rejected, the token comes from p - q where positive, renormalized.
        residual = mx.maximum(probs[:n] - q, 0.0)
        residual = mx.where(mx.sum(residual, axis=-1, keepdims=True) > 0, residual, probs[:n])  # rounding guard
        instead = mx.random.categorical(mx.log(residual), key=residual_key)
        last = mx.random.categorical(mx.log(probs[n]), key=last_key)
        accept, instead, last = accept.tolist(), instead.tolist(), last.item()
        accepted = next((i for i in range(n) if not accept[i]), n)
        return [*drafts[:accepted], instead[accepted] if accepted < n else last]

    def _penalized(self, logits: mx.array, drafts: Sequence[int]) -> mx.array:
        """`logits` (one row per position) with the repetition penalty, row i also counting drafts[:i] as seen."""
        if self._seen is None:
            return logits
        later = np.zeros((len(drafts) + 1, self._seen.size), dtype=np.bool_)
        for i, token in enumerate(drafts):
            later[i + 1 :, token] = True
        return self._penalize(logits, self._seen[None] | mx.array(later))

    def _penalize(self, logits: mx.array, seen: mx.array) -> mx.array:
        """transformers' repetition penalty on the `seen` tokens' logits."""
        penalty = self.params.repetition_penalty
        return mx.where(seen, mx.where(logits > 0, logits / penalty, logits * penalty), logits)

    def draw(self, logits: mx.array) -> tuple[mx.array, mx.array | None]:
        """A draft model's token from `logits` (vocab,) and the distribution it was drawn from, both lazy (greedy:
        the argmax, and None: greedy checking needs no distribution). No penalty, nothing observed: a drafter's."""
        p = self.params
        logits = logits.astype(mx.float32)
        if p.is_greedy:
            return mx.argmax(logits, axis=-1), None
        probs = mx.softmax(filter_logits(logits / p.temperature, p.top_k, p.top_p, p.min_p), axis=-1)
        self._key, key = mx.random.split(self._key)
        return mx.random.categorical(mx.log(probs), key=key), probs


def _one_hot(tokens: mx.array, size: int) -> mx.array:
    return (mx.arange(size)[None] == tokens[:, None]).astype(mx.float32)


def filter_logits(logits: mx.array, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> mx.array:
    """Set the logits of tokens outside top-k / top-p / min-p to -inf."""
    neg_inf = mx.array(-math.inf, dtype=logits.dtype)
    if 0 < top_k < logits.shape[-1]:
        # The k-th largest, one per row (logits may be (rows, vocab)): a partition, linear in the vocabulary.
        kth = -mx.partition(-logits, top_k - 1, axis=-1)[..., top_k - 1, None]
        logits = mx.where(logits < kth, neg_inf, logits)
    if top_p < 1.0:
        probs = mx.softmax(logits, axis=-1)
        sorted_probs = mx.sort(probs, axis=-1)[..., ::-1]
        # Keep the smallest set of most likely tokens whose mass reaches top_p.
        mass_before = mx.cumsum(sorted_probs, axis=-1) - sorted_probs
        kept = mx.sum(mass_before < top_p, axis=-1, keepdims=True)
        cutoff = mx.take_along_axis(sorted_probs, kept - 1, axis=-1)
        logits = mx.where(probs < cutoff, neg_inf, logits)
    if min_p > 0.0:
        probs = mx.softmax(logits, axis=-1)
        logits = mx.where(probs < min_p * mx.max(probs, axis=-1, keepdims=True), neg_inf, logits)
    return logits
