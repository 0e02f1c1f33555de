"""The loop's model runner: the prefill of the request being admitted, a chunk a turn, and the batch's decode steps.

A decode step is plain (every row's next token, pipelined for a lone sequence,
engine/batch.py) or, when every row has drafts, one verification of them all
(engine/speculation.py). What the tokens mean (text, stops) is the output
stage's (engine/output.py); who runs, the admission's (engine/admission.py).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, replace

import mlx.core as mx

from ..cache import Cache, PrefixHit, make_cache
from ..errors import GrammarError
from ..grammar import allowed_tokens, draft_masks
from .batch import DecodeBatch, Running
from .drafting import Draft
from .job import Job
from .prefill import Prefill, message_ends
from .runtime import ModelRuntime, SchedulerConfig
from .sampling import Sampler
from .speculation import StepCosts, speculation_for
from .text import TextStream


@dataclass
class Prefilling:
    """The request being admitted: its prompt running into its cache, a chunk per turn."""

    run: Prefill
    sequence: Running
    hidden: mx.array | None = None  # the prompt's last hidden states, once the target has run all of it


class ModelRunner:
    """Runs the model for the loop: at most one prefill in progress, and the rows decoding together."""

    def __init__(self, runtime: ModelRuntime, config: SchedulerConfig):
        self.runtime, self.config = runtime, config
        self.batch = DecodeBatch(runtime.decoder, runtime.kv_bits)
        self.prefilling: Prefilling | None = None
        self.vocab = getattr(runtime.decoder, "vocab_size", None) or runtime.decoder.model.embed_tokens.weight.shape[0]
        self.costs = runtime.step_costs or StepCosts()  # the model's, shared with later loops where it has one
        self.plain_batch_steps: Counter[str] = Counter()  # batch steps not speculated while a row could, by reason

    @property
    def rows(self) -> list[Running]:
        return self.batch.rows

    @property
    def sequences(self) -> list[Running]:
        """Every sequence it holds: the decoding rows, then the one prefilling."""
        return self.batch.rows + ([self.prefilling.sequence] if self.prefilling else [])

    def start(self, job: Job, chunk: int, hit: PrefixHit | None, shared: int, text: TextStream) -> None:
        """Begin `job`'s prefill, resuming from `hit` where the prefix cache had part of its prompt.

        `shared`: tokens the prompt shares with a cached one (a state snapshot is taken there)."""
        runtime, prompt_ids = self.runtime, job.prompt_ids
        # Room for the whole prompt and the answer's first step at once: a long prefill then copies nothing.
        cache = make_cache(runtime.decoder.cache_kinds, runtime.kv_bits, positions=len(prompt_ids) + 1)
        if hit:
            hit.restore(cache)
        prompt = mx.array(prompt_ids, dtype=mx.uint32)
        sampler = Sampler(job.sampling, self.vocab)
        sampler.observe(prompt)
        eos = runtime.eos_token_ids if job.eos_token_ids is None else job.eos_token_ids
        sequence = Running(job, sampler, text, hit, eos=eos)
        draft = runtime.draft if runtime.draft is None or job.use_cache else replace(runtime.draft, prefix_cache=None)
        # A warm reads its prefix into the draft model's prefix cache too (it decodes nothing).
        mode = ("draft" if draft is not None else "off") if job.warm else job.speculate
        sequence.speculation = speculation_for(
            mode, runtime.decoder, draft, prompt_ids, job.sampling, self.vocab, job.stats, self.costs, bool(job.images)
        )
        # Where this prompt leaves a cached one is where the next ones sharing it will want to resume.
        marks = [*message_ends(prompt_ids, runtime.eos_token_ids), shared]
        inherited = hit.snapshots if hit else None
        rest = prompt[cache[0].length :]
        every = job.snapshot_every or self.config.snapshot_every
        # A warmed prefix is continued by later prompts, never repeated whole: no snapshot before its end.
        run = Prefill.start(runtime.decoder, cache, rest, chunk, every, marks, inherited, before_end=not job.warm,
                            images=job.images, adapter=job.adapter.slot)  # fmt: skip
        sequence.snapshots = run.snapshots  # the same dict: snapshots taken later join it
        self.prefilling = Prefilling(run, sequence)

    def prefill_step(self) -> tuple[Running, list[Cache], int | None] | None:
        """Run the next chunk of the prompt; once all of it ran, the sequence, its cache and its first token
        (evaluated; None for a warm, which draws none). None while the prefill goes on."""
        p = self.prefilling
        if p is None:
            return None
        # A draft model reads the prompt alongside, a chunk per turn as the target's own, so it drafts at once.
        # Where the target resumed more of the prompt from its prefix cache, auto does not wait for it.
        speculation = p.sequence.speculation
        reading = speculation is not None and speculation.read_prompt(p.run.chunk)
        if not p.run.finished:  # (a warm may find all of its prompt cached)
            hidden = p.run.step()
            p.hidden = hidden[:, -1:] if p.run.finished else None
        if not p.run.finished or (reading and speculation.waits_for_draft_model()):
            return None
        self.prefilling = None
        if p.sequence.job.warm:
            return p.sequence, p.run.cache, None
        logits = p.run.head(p.hidden[:, -1])[0]
        constraint = p.sequence.job.constraint
        allowed = None
        if constraint is not None:
            mx.async_eval(logits)  # the device finishes the prompt while the grammar computes its first mask
            allowed = allowed_tokens([constraint], logits.shape[-1])[0]
        token = p.sequence.sampler(logits, allowed)
        mx.eval(token)
        return p.sequence, p.run.cache, int(token.item())

    def decode_step(self, settled: bool) -> tuple[list[list[int]], int | None]:
        """One step of every row: each row's tokens to emit (all rows as many), and the drafts each verified
        (None: a plain step). `settled`: no row joins before the next step, so it may be queued now (pipelined)."""
        rows = len(self.batch.rows)
        drafted = None if self.batch.pending else self._drafts()
        started = time.perf_counter()
        if drafted is None:
            # With nobody waiting to join, the device works on the next step while this one's tokens are handled
            # (unless a row may speculate next: a draft needs this step's token).
            pipelined = settled and self.config.pipelined and not any(s.may_speculate for s in self.batch.rows)
            emitted = [[token] for token in self.batch.step(pipelined=pipelined)]
        else:
            emitted = self.batch.verify(*drafted)
        checked = len(drafted[0][0].tokens) if drafted else None
        self.costs.add(rows * (1 + (checked or 0)), time.perf_counter() - started, verified=bool(checked))
        return emitted, checked

    def _drafts(self) -> tuple[list[Draft], list[mx.array | None]] | None:
        """Every row's drafts, cut to the same length, and its grammar's masks for them; None to step plainly."""
        rows = self.batch.rows
        speculating = [s.may_speculate for s in rows]
        if not all(speculating):  # a batch verifies every row or none: drafting for some would be thrown away
            if any(speculating):
                self.plain_batch_steps["row_not_speculating"] += 1
            return None
        drafts, masks = [], []
        for sequence in rows:
            draft, mask = self._draft(sequence)
            if draft is None:  # the rows that drafted take their drafts back as the step goes plainly
                if len(rows) > 1:
                    self.plain_batch_steps["row_without_draft"] += 1
                return None
            drafts.append(draft)
            masks.append(mask)
        k = min(len(d.tokens) for d in drafts)
        return [d.cut(k) for d in drafts], [None if m is None else m[: k + 1] for m in masks]

    def _draft(self, sequence: Running) -> tuple[Draft | None, mx.array | None]:
        """One row's drafts (cut at an end of sequence and where its grammar forbids them), and their masks."""
        job, speculation = sequence.job, sequence.speculation
        assert speculation is not None
        room = job.max_tokens - job.stats.generated_tokens - 1
        draft = speculation.draft(sequence.drawn, room, len(self.batch.rows))
        if draft is None:
            return None, None
        eos = sequence.eos
        cut = next((i for i, t in enumerate(draft.tokens) if t in eos or t >= self.vocab), len(draft.tokens))
        mask = None
        if job.constraint is not None:
            try:
                cut, mask = draft_masks(job.constraint, draft.tokens[:cut], self.vocab)
            except GrammarError as error:  # this row's grammar failed: it ends at its next token, alone
                sequence.failure = error
                return None, None
        if not cut:
            return None, None
        return draft.cut(cut), mask

    def join(self, sequence: Running, cache: list[Cache]) -> None:
        """A prefilled sequence decodes with the others from the next step."""
        self.batch.join(sequence, cache)

    def row_cache(self, row: int) -> list[Cache]:
        return self.batch.row_cache(row)

    def leave(self, rows: list[int]) -> None:
        self.batch.leave(rows)

    def clear(self) -> None:
        """Drop every sequence (their jobs were ended)."""
        self.batch.clear()
        self.prefilling = None
