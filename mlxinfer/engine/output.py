"""The loop's output stage: sampled tokens become text and events; stops, grammars' ends and stats are judged here.

Each drawn token is accepted or ends its sequence (EOS, a stop string, a finished
grammar, max_tokens); its text goes to the job's listener as a Delta, and the end
as Finished with the request's stats filled in (or Failed, with why).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import mlx.core as mx

from ..cache import PrefixHit
from ..errors import GrammarError
from ..tokenizer import Tokenizer
from .batch import Running
from .job import Delta, Event, Failed, Finished, Job
from .text import TextStream

log = logging.getLogger("mlxinfer.scheduler")


class OutputProcessor:
    """Tokens in, a job's events out: detokenizing, stop rules and stats."""

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self.service_s = 5.0  # running mean of a request's time in the batch, for Retry-After

    def text_stream(self, job: Job) -> TextStream:
        """The job's detokenizer, holding back text that may begin one of its stop strings."""
        return TextStream(self._decoder(job), job.stop)

    def _decoder(self, job: Job) -> Callable[[list[int]], str]:
        tokenizer = self.tokenizer
        if tokenizer is None:
            return _no_text
        if job.keep_special_tokens:  # the caller parses markup made of special tokens (tool calls, channels)
            return lambda ids: tokenizer.decode(ids, skip_special_tokens=False)
        return tokenizer.decode

    @staticmethod
    def measure_peak_from_now() -> None:
        """The peak memory from here on is the starting request's (and of those joining it): none run now."""
        mx.reset_peak_memory()

    @staticmethod
    def started(job: Job, hit: PrefixHit | None, shared: int, chunk: int) -> None:
        """The job leaves the queue for its prefill: what it waited, and what of its prompt the prefix cache had."""
        stats = job.stats
        stats.queued_s = job.elapsed()
        stats.prompt_tokens = len(job.prompt_ids)
        stats.cached_tokens = hit.tokens if hit else 0
        stats.diverged_at = hit.diverged_at if hit else None
        stats.cache_note = hit.reason if hit else ""
        if shared and not hit:
            stats.cache_note = (
                f"not resumed: the prompt shares {shared} tokens with a cached one, but no state snapshot sits at "
                "or before that; one is taken there now for the next prompt"
            )
        stats.prefilled_tokens = len(job.prompt_ids) - stats.cached_tokens
        stats.prefill_chunk = chunk

    @staticmethod
    def first_token(sequence: Running) -> None:
        """The prompt is done and its first token drawn (evaluated): time to first token and prefill speed."""
        sequence.first_token_at = time.perf_counter()
        stats = sequence.job.stats
        ttft = sequence.job.elapsed()
        stats.first_token(ttft, ttft - stats.queued_s)

    def accept_all(self, sequence: Running, tokens: list[int]) -> str | None:
        """Take a step's tokens in order until one ends the sequence (the rest are dropped)."""
        for token in tokens:
            reason = self.accept(sequence, token)
            if reason is not None:
                return reason
        return None

    @staticmethod
    def accept(sequence: Running, token: int) -> str | None:
        """Take a sampled token: emit its text; returns why the sequence ends, or None."""
        if sequence.failure is not None:
            return "error"
        sequence.drawn.append(token)
        job = sequence.job
        is_eos = token in sequence.eos
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
        emit(job, Delta(sequence.text.add(token), 1, token))  # text may be "" (a character still incomplete)
        if sequence.text.stopped or (job.constraint is not None and job.constraint.finished):
            return "stop"
        return "length" if job.stats.generated_tokens >= job.max_tokens else None

    def finish(self, sequence: Running, reason: str) -> None:
        """End the sequence's job: the text held back, then Finished with its stats (Failed if it failed)."""
        job, now = sequence.job, time.perf_counter()
        if sequence.failure is not None:
            emit(job, Failed(sequence.failure))
            return
        tail = sequence.text.finish() if reason != "cancelled" else ""
        if tail:
            emit(job, Delta(tail, 0))
        stats = job.stats
        stats.finish_reason = "stop" if sequence.text.stopped else reason
        stats.stop_sequence = sequence.text.stop_string
        stats.total_s = now - job.submitted_at
        stats.peak_memory_bytes = max(stats.peak_memory_bytes, mx.get_peak_memory())
        if sequence.first_token_at:
            stats.decoded(stats.generated_tokens - 1, now - sequence.first_token_at)
        self.service_s = 0.8 * self.service_s + 0.2 * (stats.total_s - stats.queued_s)
        emit(job, Finished(stats))


def _no_text(ids: object) -> str:
    return ""  # a runtime without a tokenizer generates ids only


def emit(job: Job, event: Event) -> None:
    """Hand `event` to the job's listener; a listener that raises must not stop the scheduler."""
    try:
        job.on_event(event)
    except Exception:  # noqa: BLE001 - the listener's bug, logged; the generation goes on
        log.exception("a request's event listener failed")
