"""The one generation loop: a turn wires the admission, the model runner and the output stage together.

Every generation runs through it. The ServingThread's thread turns it for a server
(many requests decoding together); `TextGeneration` turns it on the caller's own
thread for one request from the Python API or the CLI, a batch of one. So EOS,
max_tokens, stop strings, stats, memory fitting and the prefix cache have one
implementation, each in the role that owns it:

- admission (engine/admission.py): the waiting queue, memory fitting, eviction, the prefix cache's pins;
- runner (engine/runner.py): the chunked prefill of the request being admitted, the batch's decode steps;
- output (engine/output.py): tokens to text and events, stops, stats.

Each turn drops cancelled and expired requests, admits waiting ones while the
batch has a free place and the memory budget allows, runs one prefill chunk of
the request being admitted, then one decode step for every running sequence. So
a long prompt delays running streams by one chunk at a time, never by its whole
prefill, and a finished sequence's place is taken at the next turn. While no
request is about to join, the batch decodes pipelined (engine/batch.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from ..cache import Cache
from ..memory import MachineMemory
from .admission import Admission
from .batch import Running
from .job import Failed, Job
from .output import OutputProcessor, emit
from .runner import ModelRunner
from .runtime import SINGLE, ModelRuntime, SchedulerConfig

log = logging.getLogger("mlxinfer.scheduler")


class BatchLoop:
    """Requests in, events out; turned by one thread at a time (the ServingThread's, or a TextGeneration's caller)."""

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
        self.runtime, self.config = runtime, config
        self._log_failures = log_failures  # a server logs what failed; a caller who gets the error raised does not
        self.runner = ModelRunner(runtime, config)
        self.admission = Admission(runtime, config, self.runner, machine)
        self.output = OutputProcessor(runtime.tokenizer)

    def add(self, job: Job) -> None:
        """Queue a checked job (its events start at a later turn); its clock starts now unless it already did."""
        if not job.submitted_at:
            job.stamp()
        self.admission.waiting.append(job)

    @property
    def waiting(self) -> int:
        return len(self.admission.waiting)

    @property
    def running(self) -> int:
        return len(self.runner.rows) + (self.runner.prefilling is not None)

    def has_work(self) -> bool:
        return bool(self.admission.waiting or self.runner.prefilling or self.runner.rows)

    def turn(self) -> None:
        self.drop_cancelled()
        self._admit()
        runner = self.runner
        if runner.prefilling is not None and runner.batch.pending:
            self._guarded(self._decode_step, list(runner.rows))  # take the queued step before a row joins
        self._guarded(self._prefill_step, [runner.prefilling.sequence] if runner.prefilling else [])
        self._guarded(self._decode_step, list(runner.rows))

    def interrupt(self) -> None:
        """Ctrl-C on the thread turning the loop: keep what every layer holds, end everything as cancelled.

        KeyboardInterrupt is raised between two bytecodes, never by a failed computation: whatever the
        layers hold is sound, even mid-forward (held_positions keeps what every layer has)."""
        for job in [*self.admission.waiting, *(s.job for s in self.runner.sequences)]:
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
                self.admission.release(sequence)
                emit(sequence.job, Failed(error))
            if step == self._prefill_step:
                self.runner.prefilling = None
            else:
                self.runner.batch.clear()

    def drop_cancelled(self) -> None:
        """End cancelled and expired requests now (keeping what they computed for the prefix cache)."""
        now = self.admission.clock()
        self.admission.drop_expired(now)
        runner, prefilling = self.runner, self.runner.prefilling
        if prefilling and (prefilling.sequence.job.cancelled or prefilling.sequence.job.expired(now)):
            runner.prefilling = None
            # The chunks run so far serve a retry of the prompt.
            self._end(prefilling.sequence, _cut_reason(prefilling.sequence.job), prefilling.run.cache)
        ended = [i for i, s in enumerate(runner.rows) if s.job.cancelled or s.job.expired(now)]
        for row in ended:
            sequence = runner.rows[row]
            self._end(sequence, _cut_reason(sequence.job), runner.row_cache(row))
        runner.leave(ended)

    def _admit(self) -> None:
        for job, chunk in self.admission.admitted():
            try:
                self._start(job, chunk)
            except Exception as error:  # noqa: BLE001 - reported to the request, logged here
                if self._log_failures:
                    log.exception("could not start a request")
                emit(job, Failed(error))

    def _start(self, job: Job, chunk: int) -> None:
        if not self.runner.rows:
            self.output.measure_peak_from_now()  # (a prefix read from disk by the lookup counts in it)
        hit, shared = self.admission.lookup(job)
        try:
            self.output.started(job, hit, shared, chunk)
            self.runner.start(job, chunk, hit, shared, self.output.text_stream(job))
        except BaseException:
            self.admission.unpin(hit)
            raise

    def _prefill_step(self) -> None:
        prefilled = self.runner.prefill_step()
        if prefilled is None:
            return
        sequence, cache, token = prefilled
        if token is None:  # a warm: its prompt's state is all it makes
            error = self.admission.keep_warmed(sequence, cache)
            if error is None:
                self.output.finish(sequence, "length")
            else:
                emit(sequence.job, Failed(error))
            return
        self.output.first_token(sequence)
        reason = self.output.accept(sequence, token)
        if reason is None:
            self.runner.join(sequence, cache)
        else:
            self._end(sequence, reason, cache)

    def _decode_step(self) -> None:
        runner = self.runner
        if not runner.rows:
            return
        # Nobody joins at the next turn: nobody prefills, and nobody waits or the batch has no free place.
        full = len(runner.rows) >= self.config.max_batch
        settled = runner.prefilling is None and (full or not self.admission.waiting)
        emitted, checked = runner.decode_step(settled)
        ended = []
        for row, (sequence, tokens) in enumerate(zip(runner.rows, emitted)):
            if sequence.speculation is not None:  # its policy learns how many of its drafts were kept
                sequence.speculation.stepped(len(tokens), checked)
            reason = self.output.accept_all(sequence, tokens)
            if reason is not None:
                ended.append(row)
                self._end(sequence, reason, runner.row_cache(row))
        runner.leave(ended)

    def _end(self, sequence: Running, reason: str, cache: list[Cache]) -> None:
        """A sequence ends: its state goes to the prefix cache, its job gets its last events."""
        self.admission.keep_prefix(sequence, cache)
        self.output.finish(sequence, reason)

    def end_all(self, error: Exception) -> None:
        for sequence in self.runner.sequences:
            self.admission.release(sequence)
            emit(sequence.job, Failed(error))
        for job in self.admission.waiting:
            emit(job, Failed(error))
        self.admission.waiting.clear()
        self.runner.clear()


def _cut_reason(job: Job) -> str:
    """Why a request ended before its time: the client cancelled it, or its time limit passed."""
    return "cancelled" if job.cancelled else "length"
