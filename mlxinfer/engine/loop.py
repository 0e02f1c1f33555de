"""The one generation loop: admission, chunked prefill, batched decode, finishing.

Every generation runs through it. The Scheduler's thread turns it for a server
(many requests decoding together); `TextGeneration` turns it on the caller's own
thread for one request from the Python API or the CLI, a batch of one. So EOS,
max_tokens, stop strings, stats, memory fitting and the prefix cache have one
implementation.

Each turn drops cancelled and expired requests, admits waiting ones while the
batch has a free place and the memory budget allows, runs one prefill chunk of
the request being admitted, then one decode step for every running sequence. So
a long prompt delays running streams by one chunk at a time, never by its whole
prefill, and a finished sequence's place is taken at the next turn. A lone
sequence with nobody waiting decodes pipelined (engine/batch.py).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, replace

import mlx.core as mx

from ..cache import Cache, PrefixCache, PrefixHit, held_positions, make_cache
from ..errors import ConfigError, GrammarError, MemoryBudgetError, RequestTimeoutError, SamplingError
from ..grammar import allowed_tokens, draft_masks
from ..memory import MachineMemory, ModelFootprint, batch_peak_bytes, machine_memory
from ..models.decoder import DecoderLM
from ..tokenizer import Tokenizer
from ..untrusted import shown
from .batch import DecodeBatch, Running
from .drafting import Draft, DraftRuntime
from .generate import check_request
from .job import Delta, Event, Failed, Finished, Job
from .prefill import DEFAULT_PREFILL_CHUNK_TOKENS, SNAPSHOT_EVERY, Prefill, message_ends
from .sampling import Sampler
from .speculation import StepCosts, check_mode, speculation_for, uses_draft_model
from .text import TextStream

log = logging.getLogger("mlxinfer.scheduler")


@dataclass(frozen=True)
class ModelRuntime:
    """What the loop needs of a loaded model (`Model.runtime` gives it)."""

    decoder: DecoderLM
    tokenizer: Tokenizer | None  # None: ids only, no text (stop strings need it)
    prefix_cache: PrefixCache | None
    footprint: ModelFootprint | None  # None: no memory fitting (the caller sized the request)
    kv_bits: int | None
    eos_token_ids: frozenset[int]
    context_tokens: int  # the longest sequence the model was trained for
    draft: DraftRuntime | None = None  # a small model with the same tokenizer, for speculative decoding
    step_costs: StepCosts | None = None  # what the model's forward passes cost here, learned (speculation's auto)


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch: int = 8  # sequences decoding together
    max_queue: int = 64  # requests waiting for a place; more are refused (BusyError)
    prefill_chunk: int = 256  # tokens per prefill step, between decode steps of running sequences
    snapshot_every: int = SNAPSHOT_EVERY  # tokens between state snapshots (models with uncuttable layers)

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_queue", "prefill_chunk", "snapshot_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"SchedulerConfig.{name} must be a positive integer, got {shown(value)}")


# A single request from the Python API: prefilled in the chunks it asked for, alone in its batch.
SINGLE = SchedulerConfig(max_batch=1, max_queue=1, prefill_chunk=DEFAULT_PREFILL_CHUNK_TOKENS)


@dataclass
class _Prefill:
    run: Prefill
    sequence: Running
    hidden: mx.array | None = None  # the prompt's last hidden states, once the target has run all of it


class BatchLoop:
    """Requests in, events out; turned by one thread at a time (the Scheduler's, or a TextGeneration's caller)."""

    def __init__(
        self,
        runtime: ModelRuntime,
        config: SchedulerConfig = SINGLE,
        machine: Callable[[], MachineMemory] | None = None,
        log_failures: bool = True,
    ):
        if not runtime.decoder.batchable and config.max_batch > 1:
            log.warning("an unverified model runs one request at a time: batching is not supported for it")
            config = replace(config, max_batch=1)
        self.runtime, self.config, self._machine = runtime, config, machine or _this_machine
        self._log_failures = log_failures  # a server logs what failed; a caller who gets the error raised does not
        self._waiting: deque[Job] = deque()
        self._prefill: _Prefill | None = None
        self._batch = DecodeBatch(runtime.decoder, runtime.kv_bits)
        self._vocab = getattr(runtime.decoder, "vocab_size", None) or runtime.decoder.model.embed_tokens.weight.shape[0]
        self.service_s = 5.0  # running mean of a request's time in the batch, for Retry-After
        self.plain_batch_steps: Counter[str] = Counter()  # batch steps not speculated while a row could, by reason
        self._costs = runtime.step_costs or StepCosts()  # the model's, shared with later loops where it has one
        # What "now" is when requests expire: ranks of a distributed model all use rank 0's time (distributed/).
        self.clock: Callable[[], float] = time.perf_counter
        # A distributed model's ranks each hold part of it: a request fits only where it fits on every rank, so
        # each rank's verdict is combined (all true) and memory is freed one prefix at a time, the same on all.
        self.agree: Callable[[bool], bool] | None = None

    def check(self, job: Job, within_context: bool = True) -> None:
        """A SamplingError now, before queueing, for a request that can never run (or, with
        `within_context`, that could run past the model's context)."""
        check_request(job.prompt_ids, job.max_tokens, self._vocab)
        check_mode(job.speculate, self.runtime.draft)
        context = self.runtime.context_tokens
        if within_context and job.reserved_tokens > context:
            raise SamplingError(
                f"the prompt ({len(job.prompt_ids)} tokens) plus max_tokens ({job.max_tokens}) exceeds the model's "
                f"context of {context} tokens; shorten the prompt or lower max_tokens"
            )

    @staticmethod
    def stamp(job: Job) -> None:
        """The job's clock starts now (queueing counts toward its time limit and its stats)."""
        job.submitted_at = time.perf_counter()

    def add(self, job: Job) -> None:
        """Queue a checked, stamped job (its events start at a later turn)."""
        if not job.submitted_at:
            self.stamp(job)
        self._waiting.append(job)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._batch.rows) + (self._prefill is not None)

    def has_work(self) -> bool:
        return bool(self._waiting or self._prefill or self._batch.rows)

    def turn(self) -> None:
        self.drop_cancelled()
        self._admit()
        if self._prefill is not None and self._batch.pending:
            self._guarded(self._decode_step, list(self._batch.rows))  # take the queued step before a row joins
        self._guarded(self._prefill_step, [self._prefill.sequence] if self._prefill else [])
        self._guarded(self._decode_step, list(self._batch.rows))

    def interrupt(self) -> None:
        """Ctrl-C on the thread turning the loop: keep what every layer holds, end everything as cancelled.

        KeyboardInterrupt is raised between two bytecodes, never by a failed computation: whatever the
        layers hold is sound, even mid-forward (held_positions keeps what every layer has)."""
        running = [s.job for s in self._batch.rows] + ([self._prefill.sequence.job] if self._prefill else [])
        for job in [*self._waiting, *running]:
            job.cancel()
        self.drop_cancelled()

    def _guarded(self, step: Callable[[], None], affected: list[Running]) -> None:
        # A failure in one step ends the requests it touched; the server keeps serving.
        try:
            step()
        except Exception as error:  # noqa: BLE001 - reported to each request, logged here
            if self._log_failures:
                log.exception("generation step failed")
            for sequence in affected:
                self._release(sequence)
                _emit(sequence.job, Failed(error))
            if step == self._prefill_step:
                self._prefill = None
            else:
                self._batch.clear()

    def drop_cancelled(self) -> None:
        """End cancelled and expired requests now (keeping what they computed for the prefix cache)."""
        now = self.clock()
        for job in [j for j in self._waiting if j.cancelled or j.expired(now)]:
            self._waiting.remove(job)
            if not job.cancelled:
                _emit(job, Failed(RequestTimeoutError(f"waited {job.time_limit_s:g} s for a place; try again")))
        prefill = self._prefill
        if prefill and (prefill.sequence.job.cancelled or prefill.sequence.job.expired(now)):
            self._prefill = None
            self._keep_prefix(prefill.sequence, prefill.run.cache)  # the chunks run so far serve a retry of the prompt
            self._finish(prefill.sequence, "cancelled" if prefill.sequence.job.cancelled else "length")
        ended = [i for i, s in enumerate(self._batch.rows) if s.job.cancelled or s.job.expired(now)]
        for row in ended:
            sequence = self._batch.rows[row]
            self._keep_prefix(sequence, self._batch.row_cache(row))
            self._finish(sequence, "cancelled" if sequence.job.cancelled else "length")
        self._batch.leave(ended)

    def _admit(self) -> None:
        while self._waiting and self._prefill is None and len(self._batch.rows) < self.config.max_batch:
            job = self._waiting[0]
            try:
                chunk = self._fit(job)
            except MemoryBudgetError as error:
                self._waiting.popleft()
                _emit(job, Failed(error))
                continue
            if chunk is None:
                return  # wait for running sequences to finish
            self._waiting.popleft()
            try:
                self._prefill = self._start_prefill(job, chunk)
            except Exception as error:  # noqa: BLE001 - reported to the request, logged here
                if self._log_failures:
                    log.exception("could not start a request")
                _emit(job, Failed(error))

    def _fit(self, job: Job) -> int | None:
        """The prefill chunk `job` can run with now, None to wait, MemoryBudgetError if it never fits."""
        chunk = job.prefill_chunk or self.config.prefill_chunk
        if self.runtime.footprint is None:
            return chunk  # sized by the caller
        rows = [s.job.reserved_tokens for s in self._batch.rows] + [job.reserved_tokens]
        prefixes = [p for p in (self.runtime.prefix_cache, self._draft_prefix) if p is not None]
        while True:
            held = sum(p.stats.bytes_held for p in prefixes)
            ours = mx.get_active_memory() + mx.get_cache_memory()
            # MLX memory this model does not account for (another loaded model, a draft model's weights) stays taken.
            ours_now = self.runtime.footprint.weights_bytes + self._batch.nbytes + held + self._draft_rows_bytes()
            others = max(0, mx.get_active_memory() - ours_now)
            needed = batch_peak_bytes(self.runtime.footprint, rows, len(job.prompt_ids), chunk) + held + others
            needed += self._draft_peak(job, chunk)
            usable = self._machine().usable_bytes(ours)
            fits = needed <= usable if self.agree is None else self.agree(needed <= usable)
            if fits:
                return chunk
            if self._evict(needed - usable if self.agree is None else 1):
                mx.clear_cache()
            elif chunk > 16 and not self._batch.rows:
                chunk //= 2
            elif self._batch.rows:
                return None
            else:
                raise MemoryBudgetError(
                    f"a {len(job.prompt_ids)}-token prompt with max_tokens {job.max_tokens} needs "
                    f"{needed / 2**30:.2f} GiB but {usable / 2**30:.2f} GiB can be used; "
                    "lower max_tokens, shorten the prompt or quantize the KV cache (--kv-bits 8)"
                )

    @property
    def _draft_prefix(self) -> PrefixCache | None:
        return self.runtime.draft.prefix_cache if self.runtime.draft is not None else None

    def _draft_rows_bytes(self) -> int:
        """Bytes the running rows' draft-model caches hold now."""
        return sum(s.speculation.draft_bytes for s in self._batch.rows if s.speculation is not None)

    def _draft_peak(self, job: Job, chunk: int) -> int:
        """The draft-model caches of the rows that draft with it, `job` among them if it will, at their longest.
        (Its weights are loaded already; its prefill activations are a smaller model's, freed before the
        target's chunk runs.)"""
        draft = self.runtime.draft
        if draft is None or draft.footprint is None:
            return 0
        rows = [s.job.reserved_tokens for s in self._batch.rows if s.speculation and s.speculation.uses_draft_model]
        if job.warm or uses_draft_model(job.speculate, self.runtime.decoder, draft, job.sampling, self._costs):
            rows.append(job.reserved_tokens)
        return sum(draft.footprint.cache_bytes(row, chunk) for row in rows)

    def _evict(self, nbytes: int) -> int:
        """Free up to `nbytes` from the prefix caches (the target's first); returns the bytes freed."""
        freed = 0
        for prefix in (self.runtime.prefix_cache, self._draft_prefix):
            if prefix is not None and freed < nbytes:
                freed += prefix.evict(nbytes - freed)
        return freed

    def _start_prefill(self, job: Job, chunk: int) -> _Prefill:
        runtime, prompt_ids = self.runtime, job.prompt_ids
        if not self._batch.rows:
            mx.reset_peak_memory()  # the peak from here on is this request's (and of those joining it)
        cache = make_cache(runtime.decoder.cache_kinds, runtime.kv_bits)
        prefix = runtime.prefix_cache if job.use_cache else None
        hit = prefix.lookup(prompt_ids, reuse_all=job.warm) if prefix else None
        try:
            return self._prefill_from(job, chunk, cache, hit)
        except BaseException:
            if hit and runtime.prefix_cache:
                runtime.prefix_cache.release(hit)
            raise

    def _prefill_from(self, job: Job, chunk: int, cache: list[Cache], hit: PrefixHit | None) -> _Prefill:
        runtime, prompt_ids = self.runtime, job.prompt_ids
        if hit:
            hit.restore(cache)
        job.stats.queued_s = job.elapsed()
        job.stats.prompt_tokens = len(prompt_ids)
        job.stats.cached_tokens = hit.tokens if hit else 0
        job.stats.diverged_at = hit.diverged_at if hit else None
        job.stats.cache_note = hit.reason if hit else ""
        shared = self._shared(job, hit)
        if shared and not hit:
            job.stats.cache_note = (
                f"not resumed: the prompt shares {shared} tokens with a cached one, but no state snapshot sits at "
                "or before that; one is taken there now for the next prompt"
            )
        job.stats.prefilled_tokens = len(prompt_ids) - job.stats.cached_tokens
        job.stats.prefill_chunk = chunk
        prompt = mx.array(prompt_ids, dtype=mx.uint32)
        sampler = Sampler(job.sampling, self._vocab)
        sampler.observe(prompt)
        sequence = Running(job, sampler, TextStream(self._decoder(job), job.stop), hit)
        draft = runtime.draft if runtime.draft is None or job.use_cache else replace(runtime.draft, prefix_cache=None)
        # A warm reads its prefix into the draft model's prefix cache too (it decodes nothing).
        mode = ("draft" if draft is not None else "off") if job.warm else job.speculate
        sequence.speculation = speculation_for(
            mode, runtime.decoder, draft, prompt_ids, job.sampling, self._vocab, job.stats, self._costs
        )
        # Where this prompt leaves a cached one is where the next ones sharing it will want to resume.
        marks = [*message_ends(prompt_ids, runtime.eos_token_ids), shared]
        inherited = hit.snapshots if hit else None
        rest = prompt[cache[0].length :]
        every = job.snapshot_every or self.config.snapshot_every
        # A warmed prefix is continued by later prompts, never repeated whole: no snapshot before its end.
        run = Prefill.start(runtime.decoder, cache, rest, chunk, every, marks, inherited, before_end=not job.warm)
        sequence.snapshots = run.snapshots  # the same dict: snapshots taken later join it
        return _Prefill(run, sequence)

    def _decoder(self, job: Job) -> Callable[[list[int]], str]:
        tokenizer = self.runtime.tokenizer
        if tokenizer is None:
            return _no_text
        if job.keep_special_tokens:  # the caller parses markup made of special tokens (tool calls, channels)
            return lambda ids: tokenizer.decode(ids, skip_special_tokens=False)
        return tokenizer.decode

    def _shared(self, job: Job, hit: PrefixHit | None) -> int:
        """Tokens the prompt shares with the prefix cache (beyond where a hit could resume, for a snapshot there)."""
        prefix = self.runtime.prefix_cache if job.use_cache else None
        if hit or prefix is None:
            return hit.shared if hit else 0
        return prefix.shared_tokens(job.prompt_ids if job.warm else job.prompt_ids[:-1])

    def _prefill_step(self) -> None:
        p = self._prefill
        if p is None:
            return
        # A draft model reads the prompt alongside, a chunk per turn as the target's own, so it drafts at once.
        # Where the target resumed more of the prompt from its prefix cache, auto does not wait for it.
        speculation = p.sequence.speculation
        reading = speculation is not None and speculation.read_prompt(p.run.chunk)
        if not p.run.finished:  # (a warm may find all of its prompt cached)
            hidden = p.run.step()
            p.hidden = hidden[:, -1:] if p.run.finished else None
        if not p.run.finished or (reading and speculation.waits_for_draft_model()):
            return
        self._prefill, hidden = None, p.hidden
        if p.sequence.job.warm:
            self._keep_warmed(p.sequence, p.run.cache)
            return
        logits = self.runtime.decoder.head(hidden[:, -1])[0]
        constraint = p.sequence.job.constraint
        allowed = None
        if constraint is not None:
            mx.async_eval(logits)  # the device finishes the prompt while the grammar computes its first mask
            allowed = allowed_tokens([constraint], logits.shape[-1])[0]
        token = p.sequence.sampler(logits, allowed)
        mx.eval(token)
        sequence, stats = p.sequence, p.sequence.job.stats
        sequence.first_token_at = time.perf_counter()
        ttft = sequence.job.elapsed()
        stats.first_token(ttft, ttft - stats.queued_s)
        reason = self._accept(sequence, int(token.item()))
        if reason is None:
            self._batch.join(sequence, p.run.cache)
        else:
            self._keep_prefix(sequence, p.run.cache)
            self._finish(sequence, reason)

    def _decode_step(self) -> None:
        if not self._batch.rows:
            return
        rows = len(self._batch.rows)
        drafted = None if self._batch.pending else self._drafts()
        started = time.perf_counter()
        if drafted is None:
            # A lone sequence with nobody waiting keeps the device busy while its tokens are handled
            # (unless it may speculate next: a draft needs this step's token).
            lone = len(self._batch.rows) == 1 and not self._waiting and self._prefill is None
            lone = lone and not self._batch.rows[0].may_speculate
            emitted = [[token] for token in self._batch.step(pipelined=lone)]
        else:
            emitted = self._batch.verify(*drafted)
        checked = len(drafted[0][0].tokens) if drafted else None
        self._costs.add(rows * (1 + (checked or 0)), time.perf_counter() - started, verified=bool(checked))
        ended = []
        for row, (sequence, tokens) in enumerate(zip(self._batch.rows, emitted)):
            if sequence.speculation is not None:
                sequence.speculation.stepped(len(tokens), checked)
            reason = self._accept_all(sequence, tokens)
            if reason is not None:
                ended.append(row)
                self._keep_prefix(sequence, self._batch.row_cache(row))
                self._finish(sequence, reason)
        self._batch.leave(ended)

    def _drafts(self) -> tuple[list[Draft], list[mx.array | None]] | None:
        """Every row's drafts, cut to the same length, and its grammar's masks for them; None to step plainly."""
        rows = self._batch.rows
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
        draft = speculation.draft(sequence.drawn, room, len(self._batch.rows))
        if draft is None:
            return None, None
        eos = self._eos(job)
        cut = next((i for i, t in enumerate(draft.tokens) if t in eos or t >= self._vocab), len(draft.tokens))
        mask = None
        if job.constraint is not None:
            try:
                cut, mask = draft_masks(job.constraint, draft.tokens[:cut], self._vocab)
            except GrammarError as error:  # this row's grammar failed: it ends at its next token, alone
                sequence.failure = error
                return None, None
        if not cut:
            return None, None
        return draft.cut(cut), mask

    def _accept_all(self, sequence: Running, tokens: list[int]) -> str | None:
        """Take a step's tokens in order until one ends the sequence (the rest are dropped)."""
        for token in tokens:
            reason = self._accept(sequence, token)
            if reason is not None:
                return reason
        return None

    def _accept(self, sequence: Running, token: int) -> str | None:
        """Take a sampled token: emit its text; returns why the sequence ends, or None."""
        if sequence.failure is not None:
            return "error"
        sequence.drawn.append(token)
        job = sequence.job
        is_eos = token in self._eos(job)
        if job.constraint is not None:
            try:
                job.constraint.check()  # a mask past a grammar limit allows EOS only: that EOS is no answer
                if not is_eos:
                    job.constraint.advance(token)
            except GrammarError as error:  # this request's grammar failed (a limit hit): end it, not the batch
                sequence.failure = error
                return "error"
        if is_eos:
            return "stop"
        job.stats.generated_tokens += 1
        _emit(job, Delta(sequence.text.add(token), 1, token))  # text may be "" (a character still incomplete)
        if sequence.text.stopped or (job.constraint is not None and job.constraint.finished):
            return "stop"
        return "length" if job.stats.generated_tokens >= job.max_tokens else None

    def _eos(self, job: Job) -> frozenset[int]:
        return self.runtime.eos_token_ids if job.eos_token_ids is None else job.eos_token_ids

    def _keep_prefix(self, sequence: Running, cache: list[Cache]) -> None:
        """Offer the sequence's keys and values to the prefix cache (and the draft model's), then unpin what it
        reused."""
        prefix, speculation = self.runtime.prefix_cache, sequence.speculation
        if prefix is not None and sequence.job.use_cache:
            ids = sequence.ids_in_cache(held_positions(cache))
            _offer(lambda: prefix.insert(ids, cache, snapshots=sequence.snapshots))
        if speculation is not None:
            _offer(lambda: speculation.keep(sequence.drawn))
        self._release(sequence)

    def _keep_warmed(self, sequence: Running, cache: list[Cache]) -> None:
        """A warm's prompt, prefilled: into the prefix cache and, where the model has one, its store on disk."""
        job, prefix = sequence.job, self.runtime.prefix_cache
        try:
            kept = prefix is not None and prefix.insert(
                job.prompt_ids, cache, persist=prefix.store is not None, snapshots=sequence.snapshots
            )
            if sequence.speculation is not None:
                _offer(lambda: sequence.speculation.keep([]))
        finally:
            self._release(sequence)
        if not kept:
            tokens = len(job.prompt_ids)
            _emit(job, Failed(MemoryBudgetError(f"a {tokens}-token prefix does not fit the prefix cache's budget")))
            return
        self._finish(sequence, "length")

    def _release(self, sequence: Running) -> None:
        if self.runtime.prefix_cache is not None and sequence.hit is not None:
            self.runtime.prefix_cache.release(sequence.hit)
            sequence.hit = None

    def _finish(self, sequence: Running, reason: str) -> None:
        job, now = sequence.job, time.perf_counter()
        if sequence.failure is not None:
            _emit(job, Failed(sequence.failure))
            return
        tail = sequence.text.finish() if reason != "cancelled" else ""
        if tail:
            _emit(job, Delta(tail, 0))
        stats = job.stats
        stats.finish_reason = "stop" if sequence.text.stopped else reason
        stats.stop_sequence = sequence.text.stop_string
        stats.total_s = now - job.submitted_at
        stats.peak_memory_bytes = max(stats.peak_memory_bytes, mx.get_peak_memory())
        if sequence.first_token_at:
            stats.decoded(stats.generated_tokens - 1, now - sequence.first_token_at)
        self.service_s = 0.8 * self.service_s + 0.2 * (stats.total_s - stats.queued_s)
        _emit(job, Finished(stats))

    def end_all(self, error: Exception) -> None:
        sequences = list(self._batch.rows) + ([self._prefill.sequence] if self._prefill else [])
        for sequence in sequences:
            self._release(sequence)
            _emit(sequence.job, Failed(error))
        for job in self._waiting:
            _emit(job, Failed(error))
        self._waiting.clear()
        self._batch.clear()
        self._prefill = None


def _this_machine() -> MachineMemory:
    return machine_memory()  # looked up at each call, so a test can stand in another machine


def _no_text(ids: object) -> str:
    return ""  # a runtime without a tokenizer generates ids only


def _offer(keep: Callable[[], object]) -> None:
    """Keep a prefix; a cache that cannot keep it must not fail the answer."""
    try:
        keep()
    except Exception:  # noqa: BLE001 - logged; the answer stands
        log.warning("could not keep a finished request's prefix", exc_info=True)


def _emit(job: Job, event: Event) -> None:
    """Hand `event` to the job's listener; a listener that raises must not stop the scheduler."""
    try:
        job.on_event(event)
    except Exception:  # noqa: BLE001 - the listener's bug, logged; the generation goes on
        log.exception("a request's event listener failed")
