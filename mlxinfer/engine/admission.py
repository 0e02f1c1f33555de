"""The loop's scheduling: which waiting request starts next, with which prefill chunk, and the memory it may use.

A request is checked before it queues, waits in arrival order, and starts when the
batch has a free place and the memory budget allows its whole length (the batch's
peak, the prefix caches, the draft model's caches). Short of memory, the prefix
caches are evicted first, then a lone request's prefill chunk is halved; a request
that can never fit is refused. A finished sequence's keys and values are offered
to the prefix cache here, and the entry it resumed from is unpinned.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator

import mlx.core as mx

from ..cache import Cache, PrefixCache, PrefixHit, held_positions
from ..errors import MemoryBudgetError, RequestTimeoutError, SamplingError
from ..memory import MachineMemory, batch_peak_bytes, machine_memory
from .batch import Running
from .job import Failed, Job
from .output import emit
from .request import check_request
from .runner import ModelRunner
from .runtime import ModelRuntime, SchedulerConfig
from .speculation import check_mode, uses_draft_model

log = logging.getLogger("mlxinfer.scheduler")


class Admission:
    """The waiting queue and the memory budget of one loop, whose rows and prefill `runner` holds."""

    def __init__(
        self,
        runtime: ModelRuntime,
        config: SchedulerConfig,
        runner: ModelRunner,
        machine: Callable[[], MachineMemory] | None = None,
    ):
        self.runtime, self.config, self._runner = runtime, config, runner
        self._machine = machine or _this_machine
        self.waiting: deque[Job] = deque()
        # What "now" is when requests expire: ranks of a distributed model all use rank 0's time (distributed/).
        self.clock: Callable[[], float] = time.perf_counter
        # A distributed model's ranks each hold part of it: a request fits only where it fits on every rank, so
        # each rank's verdict is combined (all true) and memory is freed one prefix at a time, the same on all.
        self.agree: Callable[[bool], bool] | None = None

    def check(self, job: Job, within_context: bool = True) -> None:
        """A SamplingError now, before queueing, for a request that can never run (or, with
        `within_context`, that could run past the model's context)."""
        check_request(job.prompt_ids, job.max_tokens, self._runner.vocab)
        check_mode(job.speculate, self.runtime.draft)
        context = self.runtime.context_tokens
        if within_context and job.reserved_tokens > context:
            raise SamplingError(
                f"the prompt ({len(job.prompt_ids)} tokens) plus max_tokens ({job.max_tokens}) exceeds the model's "
                f"context of {context} tokens; shorten the prompt or lower max_tokens"
            )

    def drop_expired(self, now: float) -> None:
        """Take cancelled and expired requests out of the queue (those that timed out get a Failed event)."""
        for job in [j for j in self.waiting if j.cancelled or j.expired(now)]:
            self.waiting.remove(job)
            if not job.cancelled:
                emit(job, Failed(RequestTimeoutError(f"waited {job.time_limit_s:g} s for a place; try again")))

    def admitted(self) -> Iterator[tuple[Job, int]]:
        """Waiting jobs that start now, each with the prefill chunk it can run with, taken from the queue as they
        are yielded. Asked again before each: the batch has a free place and nothing else is prefilling."""
        runner = self._runner
        while self.waiting and runner.prefilling is None and len(runner.rows) < self.config.max_batch:
            job = self.waiting[0]
            try:
                chunk = self._fit(job)
            except MemoryBudgetError as error:
                self.waiting.popleft()
                emit(job, Failed(error))
                continue
            if chunk is None:
                return  # wait for running sequences to finish
            self.waiting.popleft()
            yield job, chunk

    def _fit(self, job: Job) -> int | None:
        """The prefill chunk `job` can run with now, None to wait, MemoryBudgetError if it never fits."""
        chunk = job.prefill_chunk or self.config.prefill_chunk
        if self.runtime.footprint is None:
            return chunk  # sized by the caller
        batch = self._runner.batch
        rows = [s.job.reserved_tokens for s in batch.rows] + [job.reserved_tokens]
        prefixes = [p for p in (self.runtime.prefix_cache, self._draft_prefix) if p is not None]
        while True:
            held = sum(p.stats.bytes_held for p in prefixes)
            ours = mx.get_active_memory() + mx.get_cache_memory()
            # MLX memory this model does not account for (another loaded model, a draft model's weights) stays taken.
            ours_now = self.runtime.footprint.weights_bytes + batch.nbytes + held + self._draft_rows_bytes()
            others = max(0, mx.get_active_memory() - ours_now)
            needed = batch_peak_bytes(self.runtime.footprint, rows, len(job.prompt_ids), chunk) + held + others
            needed += self._draft_peak(job, chunk) + (job.images.activation_bytes if job.images else 0)
            usable = self._machine().usable_bytes(ours)
            fits = needed <= usable if self.agree is None else self.agree(needed <= usable)
            if fits:
                return chunk
            if self._evict(needed - usable if self.agree is None else 1):
                mx.clear_cache()
            elif chunk > 16 and not batch.rows:
                chunk //= 2
            elif batch.rows:
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
        return sum(s.speculation.draft_bytes for s in self._runner.rows if s.speculation is not None)

    def _draft_peak(self, job: Job, chunk: int) -> int:
        """The draft-model caches of the rows that draft with it, `job` among them if it will, at their longest.
        (Its weights are loaded already; its prefill activations are a smaller model's, freed before the
        target's chunk runs.)"""
        draft = self.runtime.draft
        if draft is None or draft.footprint is None:
            return 0
        rows = [s.job.reserved_tokens for s in self._runner.rows if s.speculation and s.speculation.uses_draft_model]
        costs = self._runner.costs
        if job.warm or uses_draft_model(
            job.speculate, self.runtime.decoder, draft, job.sampling, costs, images=bool(job.images)
        ):
            rows.append(job.reserved_tokens)
        return sum(draft.footprint.cache_bytes(row, chunk) for row in rows)

    def _evict(self, nbytes: int) -> int:
        """Free up to `nbytes` from the prefix caches (the target's first); returns the bytes freed."""
        freed = 0
        for prefix in (self.runtime.prefix_cache, self._draft_prefix):
            if prefix is not None and freed < nbytes:
                freed += prefix.evict(nbytes - freed)
        return freed

    def lookup(self, job: Job) -> tuple[PrefixHit | None, int]:
        """The prefix-cache entry `job` resumes from (pinned until `release`), and the tokens its prompt shares
        with the cache (beyond where a hit could resume, for a snapshot there)."""
        prefix = self.runtime.prefix_cache if job.use_cache else None
        if prefix is None:
            return None, 0
        ids = job.cache_ids
        hit = prefix.lookup(ids, reuse_all=job.warm)
        if hit and job.images is not None and job.images.inside(hit.tokens):
            prefix.release(hit)  # (only a hash collision resumes inside an image) an image is prefilled whole
            return None, 0
        if hit:
            return hit, hit.shared
        return hit, prefix.shared_tokens(ids if job.warm else ids[:-1])

    def unpin(self, hit: PrefixHit | None) -> None:
        """Let the prefix cache evict the entry a request that never started had resumed from."""
        if hit and self.runtime.prefix_cache:
            self.runtime.prefix_cache.release(hit)

    def release(self, sequence: Running) -> None:
        """Unpin the prefix-cache entry the sequence resumed from."""
        if self.runtime.prefix_cache is not None and sequence.hit is not None:
            self.runtime.prefix_cache.release(sequence.hit)
            sequence.hit = None

    def keep_prefix(self, sequence: Running, cache: list[Cache]) -> None:
        """Offer an ending sequence's keys and values to the prefix cache (and the draft model's), then unpin what
        it reused."""
        prefix, speculation = self.runtime.prefix_cache, sequence.speculation
        if prefix is not None and sequence.job.use_cache:
            ids = sequence.ids_in_cache(held_positions(cache))
            _offer(lambda: prefix.insert(ids, cache, snapshots=sequence.snapshots))
        if speculation is not None:
            _offer(lambda: speculation.keep(sequence.drawn))
        self.release(sequence)

    def keep_warmed(self, sequence: Running, cache: list[Cache]) -> MemoryBudgetError | None:
        """A warm's prompt, prefilled: into the prefix cache and, where the model has one, its store on disk.
        Returns why it could not be kept, None if it was."""
        job, prefix = sequence.job, self.runtime.prefix_cache
        try:
            kept = prefix is not None and prefix.insert(
                job.cache_ids, cache, persist=prefix.store is not None, snapshots=sequence.snapshots
            )
            if sequence.speculation is not None:
                _offer(lambda: sequence.speculation.keep([]))
        finally:
            self.release(sequence)
        if not kept:
            return MemoryBudgetError(f"a {len(job.prompt_ids)}-token prefix does not fit the prefix cache's budget")
        return None


def _this_machine() -> MachineMemory:
    return machine_memory()  # looked up at each call, so a test can stand in another machine


def _offer(keep: Callable[[], object]) -> None:
    """Keep a prefix; a cache that cannot keep it must not fail the answer."""
    try:
        keep()
    except Exception:  # noqa: BLE001 - logged; the answer stands
        log.warning("could not keep a finished request's prefix", exc_info=True)
