"""Running sequences decoding together: one forward pass per step for all of them.

Each row keeps its own sampler (temperature, seed, repetition penalty), text
stream and stop rules; only the model call is shared. A row joins once its
prompt is prefilled and leaves the moment it finishes, so the next waiting
request can take its place (continuous batching).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from ..adapters import selected
from ..cache import Cache, PrefixHit, Snapshot
from ..cache.batch import add_row, drop_rows, row_cache
from ..cache.rewind import mark, rewind
from ..grammar import allowed_tokens
from ..models.decoder import DecoderLM
from .drafting import Draft
from .job import Job
from .sampling import Sampler
from .speculation import Speculation
from .text import TextStream


@dataclass
class Running:
    """A request past its prefill: the tokens it drew and what to feed next."""

    job: Job
    sampler: Sampler
    text: TextStream
    hit: PrefixHit | None  # the prefix-cache entry it reused, pinned until it ends
    drawn: list[int] = field(default_factory=list)  # sampled tokens; all but the last are in the cache
    first_token_at: float = 0.0
    snapshots: dict[int, Snapshot] = field(default_factory=dict)  # state snapshots from its prefill
    failure: Exception | None = None  # why it ends in error rather than normally (its grammar failed)
    speculation: Speculation | None = None  # its drafter and policy, when it decodes speculatively
    eos: frozenset[int] = frozenset()  # the ids that end it (the job's, else the model's)

    @property
    def token(self) -> int:
        return self.drawn[-1]

    @property
    def may_speculate(self) -> bool:
        """Its next step may verify drafts (so it cannot be pipelined)."""
        return self.speculation is not None and self.speculation.ready

    def ids_in_cache(self, cached: int) -> list[int]:
        """What the prefix cache keys its first `cached` positions by (images by their content, all by its adapter)."""
        return (self.job.cache_ids + self.job.adapter.keyed(self.drawn))[:cached]


class DecodeBatch:
    """The sequences now decoding and their shared cache (rows in the same order).

    `step(pipelined=True)` queues the next step on the device before the tokens
    of this one reach the caller (the device works on step n+1 while the caller
    handles step n); the loop asks for it while no row joins (nobody waiting or
    prefilling) and no row may verify drafts, and the queued step is taken first by
    the next `step`. Rows join only when nothing is queued. A row that ends leaves
    one step late: its token from the queued step is dropped with it.

    Under a grammar the next mask needs this step's token, so what is queued is
    the next forward pass alone: it runs while the caller handles this token and
    the grammars compute their masks, and is sampled once they are known."""

    def __init__(self, model: DecoderLM, kv_bits: int | None):
        self.model, self.kv_bits = model, kv_bits
        self.rows: list[Running] = []
        self.cache: list[Cache] | None = None
        self._queued: mx.array | None = None  # the next step's tokens, already computing
        self._queued_logits: mx.array | None = None  # under a grammar: the next step's logits, still to be masked
        self.shifts: mx.array | None = None  # the rows' M-RoPE shifts (_refresh_shifts)
        self.adapters: list[int] = []  # each row's adapter slot

    @property
    def pending(self) -> bool:
        """A step is queued: its tokens must be taken (by `step`) before rows join."""
        return self._queued is not None or self._queued_logits is not None

    def join(self, sequence: Running, cache: list[Cache]) -> None:
        """Add a prefilled sequence whose single-sequence cache is `cache`."""
        assert not self.pending, "take the queued step before a row joins"
        self.cache = add_row(self.cache, cache)
        self.rows.append(sequence)
        self._refresh_shifts()

    def _refresh_shifts(self) -> None:
        """Each row's M-RoPE shift (what its images moved its positions by), as the model takes them: None where
        every row's is 0. Made when rows change, not each step."""
        shifts = [_rope_shift(s) for s in self.rows]
        self.shifts = mx.array(shifts) if any(shifts) else None
        self.adapters = [s.job.adapter.slot for s in self.rows]

    def _model(self, fed: mx.array) -> mx.array:
        """The logits of `fed` (rows x positions), each row at its positions and with its adapter."""
        shifts = self.shifts
        with selected(self.model, self.adapters):
            if shifts is None:
                return self.model(fed, self.cache)
            return self.model.head(self.model.hidden(fed, self.cache, None, shifts))

    def leave(self, rows: list[int]) -> None:
        """Drop `rows`. A queued step goes on for the others: the rows' own next tokens are dropped from it (the
        cache's rows for them, which the step wrote into, go with them)."""
        if rows:
            self.cache = drop_rows(self.cache, rows) if self.cache is not None else None
            gone = set(rows)
            kept = [i for i in range(len(self.rows)) if i not in gone]
            self.rows = [self.rows[i] for i in kept]
            self._refresh_shifts()
            if not kept:
                self._queued = self._queued_logits = None
            elif self.pending:
                index = mx.array(kept)
                self._queued = self._queued[index] if self._queued is not None else None
                self._queued_logits = self._queued_logits[index] if self._queued_logits is not None else None

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.cache) if self.cache else 0

    def row_cache(self, row: int) -> list[Cache]:
        """Row `row`'s state as a single-sequence cache (for the prefix cache)."""
        assert self.cache is not None
        return row_cache(self.cache, row, self.model.cache_kinds, self.kv_bits)

    @property
    def constrained(self) -> bool:
        """Some row draws under a grammar: its next mask needs this step's token first."""
        return any(s.job.constraint is not None for s in self.rows)

    def step(self, pipelined: bool = False) -> list[int]:
        """Feed every row its last drawn token; returns the next token of each row."""
        assert self.cache is not None
        if self.constrained or self._queued_logits is not None:  # (queued under a grammar whose row has left)
            return self._masked_step(pipelined)
        picked = self._queued if self._queued is not None else self._launch(mx.array([s.token for s in self.rows]))
        self._queued = self._launch(picked) if pipelined else None
        return picked.tolist()

    def _masked_step(self, pipelined: bool) -> list[int]:
        logits = self._queued_logits
        if logits is None:
            logits = self._forward(mx.array([s.token for s in self.rows]))
        # Host work while the device runs the forward pass: each grammar's mask for this step.
        allowed = allowed_tokens([s.job.constraint for s in self.rows], logits.shape[-1])
        picked = mx.stack([s.sampler(logits[i], allowed[i]) for i, s in enumerate(self.rows)])
        self._queued_logits = self._forward(picked) if pipelined and self.constrained else None
        # Once the last row under a grammar has left, the next step is queued whole, its tokens sampled too.
        self._queued = self._launch(picked) if pipelined and not self.constrained else None
        return picked.tolist()

    def _forward(self, tokens: mx.array) -> mx.array:
        """Start computing the logits that follow `tokens` (one per row, maybe not evaluated yet)."""
        logits = self._model(tokens.astype(mx.uint32).reshape(-1, 1))[:, -1]
        mx.async_eval(logits)
        return logits

    def _launch(self, tokens: mx.array) -> mx.array:
        """Start computing the tokens that follow `tokens` (one per row, maybe not evaluated yet)."""
        logits = self._model(tokens.astype(mx.uint32).reshape(-1, 1))[:, -1]
        picked = mx.stack([s.sampler(logits[i]) for i, s in enumerate(self.rows)])
        mx.async_eval(picked)
        return picked

    def verify(self, drafts: list[Draft], masks: list[mx.array | None]) -> list[list[int]]:
        """Speculative decoding's step: feed every row its last token and its drafts (all rows drafted as many)
        in one forward pass; returns each row's tokens to emit (at least one, all rows as many).

        Each row keeps the drafts its sampler accepts; rows keep the same number (the
        fewest any row accepted, plus one: a row that accepted more takes its next
        accepted draft as that one), so they stay aligned in the cache, whose rejected
        positions are then taken back (cache/rewind.py). `masks[i]`: row i's grammar
        masks, one per position."""
        assert self.cache is not None and not self.pending
        at = mark(self.cache)
        fed = mx.array([[s.token, *d.tokens] for s, d in zip(self.rows, drafts)], dtype=mx.uint32)
        logits = self._model(fed)
        rows = enumerate(zip(self.rows, drafts, masks))
        out = [s.sampler.verify(logits[i], d.tokens, d.probs, m) for i, (s, d, m) in rows]
        kept = min(len(tokens) for tokens in out)
        out = [tokens[:kept] for tokens in out]
        held = rewind(self.cache, at, at.length + kept)
        if held < at.length + kept:  # recurrent layers went back to their state before the pass: feed them again
            with selected(self.model, self.adapters):
                self.model.hidden(fed[:, : at.length + kept - held], self.cache, None, self.shifts)
            mx.eval([c.arrays for c in self.cache])
        for sequence, tokens in zip(self.rows, out):
            sequence.sampler.observe(mx.array(tokens))
        return out

    def clear(self) -> None:
        self.rows, self.cache, self._queued, self._queued_logits, self.shifts = [], None, None, None, None
        self.adapters = []


def _rope_shift(sequence: Running) -> int:
    images = sequence.job.images
    return images.rope_shift(len(sequence.job.prompt_ids)) if images is not None else 0
