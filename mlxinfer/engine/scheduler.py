"""Continuous batching: many requests, one model, one thread that owns the device.

Each turn of the loop takes new requests, admits waiting ones while the batch
has a free place and the memory budget allows, runs one prefill chunk of the
request being admitted, then one decode step for every running sequence. So a
long prompt delays running streams by one chunk at a time, never by its whole
prefill, and a finished sequence's place is taken at the next turn.

All requests share the model's prefix cache (a prompt that starts like an
earlier one prefills only the rest) and one memory budget: a request that does
not fit waits in a bounded queue; past the queue it is refused with a retry
time. The thread sleeps on a condition variable when there is nothing to do.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from ..cache import Cache, PrefixCache, PrefixHit, held_positions, make_cache
from ..errors import BusyError, ConfigError, MemoryBudgetError, RequestTimeoutError, SamplingError, ShutdownError
from ..memory import MachineMemory, ModelFootprint, batch_peak_bytes, machine_memory
from ..models.decoder import DecoderLM
from ..tokenizer import Tokenizer
from ..untrusted import shown
from .batch import DecodeBatch, Running
from .generate import check_request
from .job import Delta, Event, Failed, Finished, Job
from .prefill import SNAPSHOT_EVERY, Prefill, message_ends
from .sampling import Sampler
from .text import TextStream
from .threads import run_on_device_thread

log = logging.getLogger("mlxinfer.scheduler")


@dataclass(frozen=True)
class ModelRuntime:
    """What the scheduler needs of a loaded model (`Model.runtime` gives it)."""

    decoder: DecoderLM
    tokenizer: Tokenizer
    prefix_cache: PrefixCache | None
    footprint: ModelFootprint
    kv_bits: int | None
    eos_token_ids: frozenset[int]
    context_tokens: int  # the longest sequence the model was trained for


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


@dataclass
class _Prefill:
    run: Prefill
    sequence: Running


class Scheduler:
    """Runs Jobs on a background thread; `submit`, `cancel` and `stop` are safe from any thread."""

    def __init__(
        self,
        runtime: ModelRuntime,
        config: SchedulerConfig | None = None,
        machine: Callable[[], MachineMemory] = machine_memory,
    ):
        self.runtime, self.config, self._machine = runtime, config or SchedulerConfig(), machine
        self._cond = threading.Condition()
        self._inbox: deque[Job] = deque()
        self._stopping: str | None = None
        self._aborting: str | None = None  # end what is in flight, keep serving
        self._waiting: deque[Job] = deque()  # the loop's own, like everything below
        self._prefill: _Prefill | None = None
        self._batch = DecodeBatch(runtime.decoder, runtime.kv_bits)
        self._vocab = runtime.decoder.model.embed_tokens.weight.shape[0]
        self._service_s = 5.0  # running mean of a request's time in the batch, for Retry-After
        # Read by other threads (metrics); plain ints are safe to read without the lock.
        self.queued = 0
        self.running = 0
        self.memory_in_use = mx.get_active_memory()
        self._stopped = run_on_device_thread(self._run, "mlxinfer-scheduler")

    # -- any thread -------------------------------------------------------

    def submit(self, job: Job) -> None:
        """Queue `job`; raises SamplingError for a bad request, BusyError when the queue is full."""
        check_request(job.prompt_ids, job.max_tokens, self._vocab)
        context = self.runtime.context_tokens
        if job.reserved_tokens > context:
            raise SamplingError(
                f"the prompt ({len(job.prompt_ids)} tokens) plus max_tokens ({job.max_tokens}) exceeds the model's "
                f"context of {context} tokens; shorten the prompt or lower max_tokens"
            )
        with self._cond:
            if self._stopping is not None:
                raise ShutdownError(self._stopping)
            if len(self._inbox) + self.queued >= self.config.max_queue:
                raise BusyError(f"all {self.config.max_queue} queue places are taken", self.retry_after_s())
            job.submitted_at = time.perf_counter()
            self._inbox.append(job)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        job.cancel()
        with self._cond:
            self._cond.notify()

    def abort(self, reason: str) -> None:
        """End every running and waiting request (each gets a Failed event) and go on serving new ones."""
        with self._cond:
            self._aborting = reason
            self._cond.notify()

    def stop(self, reason: str = "the server is shutting down", timeout: float | None = 10.0) -> None:
        """End every request (each gets a Failed event) and the thread."""
        with self._cond:
            self._stopping = self._stopping or reason
            self._cond.notify()
        self._stopped.wait(timeout)

    def retry_after_s(self) -> int:
        waiting = self.queued + len(self._inbox)
        return max(1, min(60, math.ceil(self._service_s * (1 + waiting / self.config.max_batch))))

    # -- the loop's thread ------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._has_work() or self._stopping or self._aborting):
                    self._cond.wait()
                self._waiting.extend(self._inbox)
                self._inbox.clear()
                stopping, aborting, self._aborting = self._stopping, self._aborting, None
            if stopping is not None:
                self._end_all(ShutdownError(stopping))
                return
            if aborting is not None:
                self._end_all(ShutdownError(aborting))
            try:
                self._turn()
            except Exception as error:  # noqa: BLE001 - outside the guarded steps: end what is in flight, go on
                log.exception("scheduler turn failed")
                self._end_all(error)

    def _has_work(self) -> bool:
        return bool(self._inbox or self._waiting or self._prefill or self._batch.rows)

    def _turn(self) -> None:
        self._drop_cancelled_and_expired()
        self._admit()
        self._guarded(self._prefill_step, [self._prefill.sequence] if self._prefill else [])
        self._guarded(self._decode_step, list(self._batch.rows))
        self.queued, self.running = len(self._waiting), len(self._batch.rows) + (self._prefill is not None)
        self.memory_in_use = mx.get_active_memory()
        for sequence in self._batch.rows:
            stats = sequence.job.stats
            stats.peak_memory_bytes = max(stats.peak_memory_bytes, self.memory_in_use)

    def _guarded(self, step: Callable[[], None], affected: list[Running]) -> None:
        # A failure in one step ends the requests it touched; the server keeps serving.
        try:
            step()
        except Exception as error:  # noqa: BLE001 - reported to each request, logged here
            log.exception("generation step failed")
            for sequence in affected:
                self._release(sequence)
                _emit(sequence.job, Failed(error))
            if step == self._prefill_step:
                self._prefill = None
            else:
                self._batch.clear()

    def _drop_cancelled_and_expired(self) -> None:
        now = time.perf_counter()
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
                log.exception("could not start a request")
                _emit(job, Failed(error))

    def _fit(self, job: Job) -> int | None:
        """The prefill chunk `job` can run with now, None to wait, MemoryBudgetError if it never fits."""
        rows = [s.job.reserved_tokens for s in self._batch.rows] + [job.reserved_tokens]
        prefix = self.runtime.prefix_cache
        chunk = self.config.prefill_chunk
        while True:
            held = prefix.stats.bytes_held if prefix else 0
            ours = mx.get_active_memory() + mx.get_cache_memory()
            # MLX memory this model does not account for (another loaded model) stays taken.
            others = max(0, mx.get_active_memory() - self.runtime.footprint.weights_bytes - self._batch.nbytes - held)
            needed = batch_peak_bytes(self.runtime.footprint, rows, len(job.prompt_ids), chunk) + held + others
            usable = self._machine().usable_bytes(ours)
            if needed <= usable:
                return chunk
            if prefix and prefix.evict(needed - usable):
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

    def _start_prefill(self, job: Job, chunk: int) -> _Prefill:
        runtime, prompt_ids = self.runtime, job.prompt_ids
        cache = make_cache(runtime.decoder.cache_kinds, runtime.kv_bits)
        hit = runtime.prefix_cache.lookup(prompt_ids) if runtime.prefix_cache else None
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
        job.stats.prefilled_tokens = len(prompt_ids) - job.stats.cached_tokens
        prompt = mx.array(prompt_ids, dtype=mx.uint32)
        sampler = Sampler(job.sampling, self._vocab)
        sampler.observe(prompt)
        sequence = Running(job, sampler, TextStream(runtime.tokenizer.decode, job.stop), hit)
        marks = message_ends(prompt_ids, runtime.eos_token_ids)
        inherited = hit.snapshots if hit else None
        rest = prompt[cache[0].length :]
        run = Prefill.start(runtime.decoder, cache, rest, chunk, self.config.snapshot_every, marks, inherited)
        sequence.snapshots = run.snapshots  # the same dict: snapshots taken later join it
        return _Prefill(run, sequence)

    def _prefill_step(self) -> None:
        p = self._prefill
        if p is None:
            return
        hidden = p.run.step()
        if not p.run.finished:
            return
        self._prefill = None
        token = p.sequence.sampler(self.runtime.decoder.head(hidden[:, -1])[0])
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
        tokens = self._batch.step()
        ended = []
        for row, (sequence, token) in enumerate(zip(self._batch.rows, tokens)):
            reason = self._accept(sequence, token)
            if reason is not None:
                ended.append(row)
                self._keep_prefix(sequence, self._batch.row_cache(row))
                self._finish(sequence, reason)
        self._batch.leave(ended)

    def _accept(self, sequence: Running, token: int) -> str | None:
        """Take a sampled token: emit its text; returns why the sequence ends, or None."""
        sequence.drawn.append(token)
        job = sequence.job
        if token in self.runtime.eos_token_ids:
            return "stop"
        job.stats.generated_tokens += 1
        _emit(job, Delta(sequence.text.add(token), 1))  # text may be "" (a character still incomplete)
        if sequence.text.stopped:
            return "stop"
        return "length" if job.stats.generated_tokens >= job.max_tokens else None

    def _keep_prefix(self, sequence: Running, cache: list[Cache]) -> None:
        """Offer the sequence's keys and values to the prefix cache, then unpin what it reused."""
        prefix = self.runtime.prefix_cache
        try:
            if prefix is not None:
                ids = sequence.ids_in_cache(held_positions(cache))  # generate_ids' rule too
                prefix.insert(ids, cache, snapshots=sequence.snapshots)
        except Exception:  # noqa: BLE001 - a cache that cannot keep this prefix must not fail the answer
            log.warning("could not keep a finished request's prefix", exc_info=True)
        self._release(sequence)

    def _release(self, sequence: Running) -> None:
        if self.runtime.prefix_cache is not None and sequence.hit is not None:
            self.runtime.prefix_cache.release(sequence.hit)
            sequence.hit = None

    def _finish(self, sequence: Running, reason: str) -> None:
        job, now = sequence.job, time.perf_counter()
        tail = sequence.text.finish() if reason != "cancelled" else ""
        if tail:
            _emit(job, Delta(tail, 0))
        stats = job.stats
        stats.finish_reason = "stop" if sequence.text.stopped else reason
        stats.total_s = now - job.submitted_at
        stats.peak_memory_bytes = max(stats.peak_memory_bytes, mx.get_active_memory())
        if sequence.first_token_at:
            stats.decoded(stats.generated_tokens - 1, now - sequence.first_token_at)
        self._service_s = 0.8 * self._service_s + 0.2 * (stats.total_s - stats.queued_s)
        _emit(job, Finished(stats))

    def _end_all(self, error: Exception) -> None:
        sequences = list(self._batch.rows) + ([self._prefill.sequence] if self._prefill else [])
        for sequence in sequences:
            self._release(sequence)
            _emit(sequence.job, Failed(error))
        for job in self._waiting:
            _emit(job, Failed(error))
        self._waiting.clear()
        self._batch.clear()
        self._prefill = None
        self.queued = self.running = 0


def _emit(job: Job, event: Event) -> None:
    """Hand `event` to the job's listener; a listener that raises must not stop the scheduler."""
    try:
        job.on_event(event)
    except Exception:  # noqa: BLE001 - the listener's bug, logged; the generation goes on
        log.exception("a request's event listener failed")
