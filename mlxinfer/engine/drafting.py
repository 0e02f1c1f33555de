"""Where speculative decoding's drafts come from: the text so far (prompt lookup) or a small draft model.

A drafter proposes up to k tokens to follow a sequence; the target model checks
them all in one forward pass (engine/batch.py) and says how many it kept
(`accepted`). Both drafters see the sequence as its prompt plus the tokens drawn
so far, which only ever grows.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from ..cache import PrefixCache, held_positions, make_cache
from ..cache.rewind import Mark, mark, rewind
from ..memory import ModelFootprint
from ..models.decoder import DecoderLM
from .sampling import Sampler, SamplingParams

LOOKUP_WINDOW = 8192  # positions prompt lookup searches: the latest ones
CATCH_UP_TOKENS = 512  # tokens a draft model that lost its cache is fed per step, between other work


@dataclass(frozen=True)
class DraftRuntime:
    """A loaded draft model and what serves it: its own prefix cache (what earlier requests read stays read)
    and its memory footprint (its cache per row counts in the memory plan)."""

    decoder: DecoderLM
    prefix_cache: PrefixCache | None = None
    footprint: ModelFootprint | None = None


@dataclass(frozen=True)
class Draft:
    tokens: list[int]
    probs: mx.array | None = None  # (len(tokens), vocab): what each token was drawn from; None: certain
    seconds: float = 0.0  # time spent drafting these tokens

    def cut(self, n: int) -> Draft:
        """The first `n` drafts."""
        return Draft(self.tokens[:n], None if self.probs is None else self.probs[:n], self.seconds)


class PromptLookup:
    """Proposes what followed the latest earlier occurrence of the sequence's last n tokens (n = 4, 3, then 2).

    Each position is indexed once, as the sequence grows, so a proposal costs a few
    dictionary lookups however long the context: a 1,000-token document being
    summarised or edited repeats itself in the answer, and those repeats are drafted."""

    NGRAMS = (4, 3, 2)

    def __init__(self, prompt: Sequence[int]):
        self.context = list(prompt)
        self._prompt = len(self.context)
        self._follows: dict[tuple[int, ...], int] = {}  # n-gram -> the position after its latest occurrence
        self._indexed = 0

    def propose(self, drawn: Sequence[int], k: int) -> Draft:
        context = self.context
        context.extend(drawn[len(context) - self._prompt :])
        # n-grams followed by at least one token, indexed once each; only the latest LOOKUP_WINDOW positions, so a
        # huge prompt costs a bounded first proposal (on the scheduler's thread) and bounded memory.
        for end in range(max(self._indexed, len(context) - LOOKUP_WINDOW), len(context)):
            for n in self.NGRAMS:
                if end >= n:
                    self._follows[tuple(context[end - n : end])] = end
        self._indexed = len(context)
        for n in self.NGRAMS:
            at = self._follows.get(tuple(context[-n:])) if len(context) > n else None
            if at is not None:
                return Draft(context[at : at + k])
        return Draft([])

    def accepted(self, n: int) -> None:
        """The target kept `n` of the proposed tokens (lookup has nothing to take back)."""


class DraftModel:
    """A small model sharing the target's tokenizer, drafting one token after another from its own cache.

    Its cache holds the sequence up to `fed`. It reads the prompt while the target
    prefills (`read`, a chunk per scheduler turn, resuming from its own prefix cache),
    so drafting never waits on it; a proposal feeds what the target drew since, then
    k tokens, and `accepted` cuts the cache back to the drafts kept (a recurrent draft
    model restores its state and feeds them again next time)."""

    def __init__(
        self, model: DecoderLM, prompt: Sequence[int], params: SamplingParams, vocab: int,
        prefix: PrefixCache | None = None,
    ):  # fmt: skip
        self.model, self.vocab, self.prefix = model, vocab, prefix
        self.cache = make_cache(model.cache_kinds)
        self.context = list(prompt)
        self._prompt = len(self.context)
        self.fed = self._resume(prefix)
        # The drafter's own random stream (no repetition penalty: q only has to be what drafts were drawn from).
        seed = None if params.seed is None else (params.seed + 1) % 2**63
        drafting = SamplingParams(params.temperature, params.top_p, params.top_k, params.min_p, seed=seed)
        self.sampler = Sampler(drafting, vocab)
        self._mark: Mark | None = None
        self._proposed = 0

    def _resume(self, prefix: PrefixCache | None) -> int:
        """Positions of the prompt restored from the draft model's prefix cache."""
        hit = prefix.lookup(self.context) if prefix is not None else None
        if hit is None:
            return 0
        try:  # the restored arrays are the cache's own; the entry may be evicted while this row holds them
            hit.restore(self.cache)
        finally:
            prefix.release(hit)
        return hit.tokens

    @property
    def unread(self) -> int:
        """Prompt tokens not read yet."""
        return max(0, self._prompt - self.fed)

    def read(self, tokens: int) -> int:
        """Read up to `tokens` more of the prompt; returns how many were read."""
        ids = self.context[self.fed : min(self._prompt, self.fed + tokens)]
        if ids:
            self._feed(ids)
        return len(ids)

    def keep(self, drawn: Sequence[int]) -> None:
        """Offer what the cache holds (the prompt and some of `drawn`, the sequence's tokens so far) to the draft
        model's prefix cache, for the next prompt that shares it."""
        self.context.extend(drawn[len(self.context) - self._prompt :])  # kept drafts are drawn tokens
        held = held_positions(self.cache)
        if self.prefix is not None and held:
            self.prefix.insert(self.context[:held], self.cache)

    def propose(self, drawn: Sequence[int], k: int) -> Draft:
        self.context.extend(drawn[len(self.context) - self._prompt :])
        behind = len(self.context) - self.fed
        if behind > CATCH_UP_TOKENS:  # started afresh (see `accepted`): a chunk per step, no draft yet
            self._feed(self.context[self.fed : self.fed + CATCH_UP_TOKENS])
            return Draft([])
        started = time.perf_counter()
        hidden = self.model.hidden(mx.array([self.context[self.fed :]], dtype=mx.uint32), self.cache)
        logits = self.model.head(hidden[:, -1])[0]
        if behind > 1:  # catching up (the prompt's end, a recurrent state's feed-again) is not drafting
            mx.eval(logits)
            started = time.perf_counter()
        self.fed = len(self.context)
        self._mark, self._proposed = mark(self.cache), k
        tokens, probs = [], []
        for i in range(k):
            token, q = self.sampler.draw(logits[: self.vocab])
            tokens.append(token)
            probs.append(q)
            if i + 1 < k:  # lazy: the k steps run as one graph
                logits = self.model(token.reshape(1, 1).astype(mx.uint32), self.cache)[0, -1]
        qs = None if probs[0] is None else _widened(mx.stack(probs), self.vocab)
        mx.eval(tokens, *([] if qs is None else [qs]))
        return Draft([int(t.item()) for t in tokens], qs, time.perf_counter() - started)

    def _feed(self, ids: list[int]) -> None:
        self.model.hidden(mx.array([ids], dtype=mx.uint32), self.cache)
        mx.eval([c.arrays for c in self.cache])
        self.fed += len(ids)

    def accepted(self, n: int) -> None:
        """The target kept `n` drafts: the cache keeps those it was fed (all but the last drafted)."""
        if self._mark is not None:
            try:
                self.fed = rewind(self.cache, self._mark, self._mark.length + min(n, self._proposed - 1))
            except ValueError:  # a window smaller than the drafts fed let go of what is kept: start again
                self.cache, self.fed = make_cache(self.model.cache_kinds), 0
            self._mark = None


def _widened(probs: mx.array, vocab: int) -> mx.array:
    """Draft distributions over the target's vocabulary (a draft's embedding table may be padded differently)."""
    width = probs.shape[-1]
    if width >= vocab:
        return probs[:, :vocab]
    return mx.concatenate([probs, mx.zeros((probs.shape[0], vocab - width), probs.dtype)], axis=1)
