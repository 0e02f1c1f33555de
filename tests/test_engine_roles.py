"""The generation loop's roles, each alone and without a model: the output stage judges drawn tokens, the
admission orders, checks and drops requests. (The loop's wiring of them is tested end to end elsewhere.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mlxinfer.engine import Delta, Failed, Finished, Job, ModelRuntime, SchedulerConfig
from mlxinfer.engine.admission import Admission
from mlxinfer.engine.batch import Running
from mlxinfer.engine.output import OutputProcessor
from mlxinfer.engine.text import TextStream
from mlxinfer.errors import RequestTimeoutError, SamplingError

EOS = 0


def letters(ids: list[int]) -> str:
    return "".join(chr(ord("a") + i % 26) for i in ids)  # token 1 is "b", 2 is "c", ...


def sequence(max_tokens: int = 8, stop: tuple[str, ...] = ()) -> tuple[Running, list]:
    events: list = []
    job = Job([1, 2, 3], events.append, max_tokens=max_tokens, stop=stop)
    job.stamp()
    return Running(job, None, TextStream(letters, job.stop), None, eos=frozenset({EOS})), events


def test_eos_ends_a_sequence_without_a_delta():
    sent, events = sequence()
    output = OutputProcessor(tokenizer=None)
    assert output.accept(sent, 1) is None
    assert output.accept(sent, EOS) == "stop"
    assert [e.token for e in events] == [1] and sent.job.stats.generated_tokens == 1


def test_max_tokens_ends_a_step_and_drops_the_tokens_after_it():
    sent, events = sequence(max_tokens=2)
    assert OutputProcessor(tokenizer=None).accept_all(sent, [1, 2, 3]) == "length"
    assert [e.token for e in events] == [1, 2]


def test_a_stop_string_ends_the_text_before_it_and_finish_reports_it():
    sent, events = sequence(stop=("cd",))
    output = OutputProcessor(tokenizer=None)
    reason = output.accept_all(sent, [1, 2, 3, 4])
    output.finish(sent, reason)
    assert "".join(e.text for e in events if isinstance(e, Delta)) == "b"
    finished = events[-1]
    assert isinstance(finished, Finished)
    assert (finished.stats.finish_reason, finished.stats.stop_sequence) == ("stop", "cd")


def admission(max_batch: int = 2, rows: int = 0) -> tuple[Admission, SimpleNamespace]:
    """An admission over a stand-in runner holding `rows` decoding rows (no footprint: no memory fitting)."""
    runtime = ModelRuntime(None, None, None, None, None, frozenset({EOS}), context_tokens=64)
    held = [object()] * rows
    runner = SimpleNamespace(prefilling=None, rows=held, batch=SimpleNamespace(rows=held), vocab=16)
    return Admission(runtime, SchedulerConfig(max_batch=max_batch, prefill_chunk=32), runner), runner


def test_requests_start_in_order_one_prefill_at_a_time_with_their_own_chunk():
    queue, runner = admission()
    first, second = Job([1], print, prefill_chunk=8), Job([2], print)
    queue.waiting.extend([first, second])
    starting = queue.admitted()
    assert next(starting) == (first, 8)
    runner.prefilling = object()  # the runner took it: nobody else starts before its prefill is done
    assert list(starting) == [] and list(queue.waiting) == [second]
    runner.prefilling = None
    assert list(queue.admitted()) == [(second, 32)]


def test_a_full_batch_starts_nobody():
    queue, _ = admission(max_batch=1, rows=1)
    queue.waiting.append(Job([1], print))
    assert list(queue.admitted()) == [] and len(queue.waiting) == 1


def test_a_request_past_its_time_limit_fails_and_a_cancelled_one_leaves_quietly():
    (queue, _), events = admission(), []
    late, gone = Job([1], events.append, time_limit_s=1.0), Job([2], events.append)
    late.submitted_at = gone.submitted_at = 10.0
    gone.cancel()
    queue.waiting.extend([late, gone])
    queue.drop_expired(now=12.0)
    assert not queue.waiting
    assert len(events) == 1 and isinstance(events[0], Failed) and isinstance(events[0].error, RequestTimeoutError)


def test_a_request_outside_the_vocabulary_or_the_context_is_refused_before_it_queues():
    queue, _ = admission()
    with pytest.raises(SamplingError, match="outside the model's vocabulary"):
        queue.check(Job([16], print))
    long = Job([1] * 10, print, max_tokens=60)
    with pytest.raises(SamplingError, match="exceeds the model's context of 64 tokens"):
        queue.check(long)
    queue.check(long, within_context=False)  # the Python API may run past it
