"""Continuous batching: batched caches, the scheduler's admission, interleaving, cancellation and limits."""

from __future__ import annotations

import dataclasses
import threading

import mlx.core as mx
import pytest

import mlxinfer
from mlxinfer.cache import make_cache
from mlxinfer.cache.batch import add_row, drop_rows, row_cache
from mlxinfer.engine import Delta, Failed, Finished, Job, SamplingParams, SchedulerConfig, ServingThread
from mlxinfer.errors import BusyError, MemoryBudgetError, RequestTimeoutError, SamplingError, ShutdownError
from mlxinfer.memory import MachineMemory
from mlxinfer.models.config import FULL
from tests.conftest import ARCHITECTURES, TINY

PROMPTS = [
    list(range(3, 16)),
    [40, 41],
    [100 + (i * 7) % 90 for i in range(37)],
]


class Collector:
    """Gathers one job's events; `wait` blocks until its final event."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.ids: list[int] = []
        self.end: Finished | Failed | None = None
        self.done = threading.Event()
        self.first = threading.Event()

    def __call__(self, event) -> None:
        if isinstance(event, Delta):
            self.texts.append(event.text)
            self.ids += [event.token] if event.token is not None else []
            self.first.set()
        else:
            self.end = event
            self.done.set()

    def wait(self, timeout: float = 120) -> Collector:
        assert self.done.wait(timeout), "the job never ended"
        return self

    @property
    def text(self) -> str:
        return "".join(self.texts)


def run_jobs(scheduler: ServingThread, prompts: list[list[int]], max_tokens: int, **job) -> list[Collector]:
    collectors = [Collector() for _ in prompts]
    for prompt, collector in zip(prompts, collectors):
        scheduler.submit(Job(prompt, collector, max_tokens=max_tokens, **job))
    return [c.wait() for c in collectors]


def batch_sizes(scheduler: ServingThread) -> list[int]:
    """Sizes of the decode batches seen from the scheduler's thread (one entry per event)."""
    seen: list[int] = []
    step = scheduler._batch.step

    def recorded(pipelined: bool = False) -> list[int]:
        seen.append(len(scheduler._batch.rows))
        return step(pipelined)

    scheduler._batch.step = recorded
    return seen


def no_pins(model) -> bool:
    return all(entry.pins == 0 for entry in model.prefix_cache._entries.values())


@pytest.mark.slow
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_batched_greedy_equals_each_request_alone(name, scheduler_for):
    model = mlxinfer.load(TINY / name, dtype="float32", prefix_cache_bytes=0)
    alone = [model.generate(p, max_tokens=20) for p in PROMPTS]
    scheduler = scheduler_for(model, max_batch=3, prefill_chunk=16)
    sizes = batch_sizes(scheduler)
    together = run_jobs(scheduler, PROMPTS, max_tokens=20)
    assert max(sizes) >= 2  # they really decoded together
    for single, batched in zip(alone, together):
        assert isinstance(batched.end, Finished)
        assert batched.text == single.text
        assert batched.end.stats.finish_reason == single.finish_reason
        assert batched.end.stats.generated_tokens == single.stats.generated_tokens


def test_rows_join_and_leave_without_disturbing_the_others(tiny_llama):
    lm = tiny_llama._loaded.model

    def prefilled(prompt):
        cache = make_cache(lm.cache_kinds)
        logits = lm(mx.array([prompt]), cache)[0, -1]
        return cache, int(mx.argmax(logits).item())

    def alone(prompt, steps):
        cache, token = prefilled(prompt)
        out = [token]
        for _ in range(steps):
            token = int(mx.argmax(lm(mx.array([[token]]), cache)[0, -1]).item())
            out.append(token)
        return out

    batch, tokens, outs = None, [], []
    for prompt in PROMPTS[:2]:
        cache, token = prefilled(prompt)
        batch = add_row(batch, cache)
        tokens.append(token)
        outs.append([token])
    for step in range(8):
        if step == 2:  # a longer prompt joins: the others are padded on the left
            cache, token = prefilled(PROMPTS[2])
            batch = add_row(batch, cache)
            tokens.append(token)
            outs.append([token])
        if step == 5:  # the first leaves: padding all rows share is cut
            batch = drop_rows(batch, [0])
            tokens, finished = tokens[1:], outs.pop(0)
            assert finished == alone(PROMPTS[0], len(finished) - 1)
        tokens = mx.argmax(lm(mx.array([[t] for t in tokens]), batch)[:, -1], axis=-1).tolist()
        for out, token in zip(outs, tokens):
            out.append(token)
    assert outs[0] == alone(PROMPTS[1], len(outs[0]) - 1)
    assert outs[1] == alone(PROMPTS[2], len(outs[1]) - 1)
    assert min(batch[0].left_padding) == 0
    assert batch[0].length == len(PROMPTS[2]) + len(outs[1]) - 1

    # A row taken out for the prefix cache holds exactly that sequence's keys and values.
    single = row_cache(batch, 0, lm.cache_kinds, None)
    reference, _ = prefilled(PROMPTS[1] + outs[0][:-1])
    assert single[0].length == reference[0].length
    for got, want in zip(single[0].state, reference[0].state):
        assert mx.allclose(got, want, atol=1e-4)


def test_a_pipelined_batch_drops_the_rows_that_end_and_decodes_the_others_as_alone(tiny_llama, scheduler_for):
    """Issue 37 item 2: a batch queues step t+1 before step t's tokens are handled; a row that ends leaves one step
    late, its extra token dropped. The middle row ends first, then the last, so a wrong row kept shows."""
    lm, eos = tiny_llama._loaded.model, set(tiny_llama.eos_token_ids)

    def greedy(prompt: list[int], n: int) -> list[int]:  # the reference: the model's own greedy loop, no engine
        cache, out = make_cache(lm.cache_kinds), []
        logits = lm(mx.array([prompt]), cache)[0, -1]
        while len(out) < n:
            token = int(mx.argmax(logits).item())
            if token in eos:
                break
            out.append(token)
            logits = lm(mx.array([[token]]), cache)[0, -1]
        return out

    scheduler = scheduler_for(tiny_llama, max_batch=3, prefill_chunk=64)
    steps: list[tuple[int, bool]] = []
    step = scheduler._batch.step

    def recorded(pipelined: bool = False) -> list[int]:
        steps.append((len(scheduler._batch.rows), pipelined))
        return step(pipelined)

    scheduler._batch.step = recorded
    lengths = [60, 6, 30]  # greedy, the first and the last end at an EOS: after 40 and 10 tokens
    collectors = [Collector() for _ in PROMPTS]
    for prompt, n, collector in zip(PROMPTS, lengths, collectors):
        scheduler.submit(Job(prompt, collector, max_tokens=n, sampling=SamplingParams(temperature=0.0)))
    for prompt, n, collector in zip(PROMPTS, lengths, collectors):
        assert collector.wait().ids == greedy(prompt, n)
    pipelined_rows = [rows for rows, pipelined in steps if pipelined]
    assert 3 in pipelined_rows and 2 in pipelined_rows, str(steps)  # pipelined with all three rows, and after one left


def test_a_decode_step_of_rows_of_one_length_needs_no_mask(tiny_llama):
    # A mask costs an op per layer and, on a GPU, a slower attention kernel: a lone row or rows without left
    # padding see every key they hold. Padding to hide still gets its mask.
    lm = tiny_llama._loaded.model
    assert lm.mask(1, 10, FULL, left_padding=[0]) is None and lm.mask(1, 10, FULL, left_padding=[0, 0]) is None
    mask = lm.mask(1, 10, FULL, left_padding=[0, 3])
    assert mask.shape == (2, 1, 1, 11) and mask[1, 0, 0].tolist() == [False] * 3 + [True] * 8
    assert mask[0].all().item()


def test_quantized_kv_rows_batch_like_single_requests(smol_path, scheduler_for):
    model = mlxinfer.load(smol_path, kv_bits=8, prefix_cache_bytes=0)
    prompts = [model.encode_prompt(q, chat=True) for q in ("What is the capital of France?", "What is 2+2?")]
    alone = [model.generate(p, max_tokens=10).text for p in prompts]
    scheduler = scheduler_for(model, max_batch=2)
    sizes = batch_sizes(scheduler)
    together = run_jobs(scheduler, prompts, max_tokens=10)
    assert [c.text for c in together] == alone
    assert max(sizes) == 2
    assert "Paris" in alone[0]


def test_a_long_prefill_runs_in_chunks_between_decode_steps(tiny_llama, scheduler_for):
    scheduler = scheduler_for(tiny_llama, prefill_chunk=8)
    joining = Collector()
    long_prompt = Job([(i * 11) % 250 + 3 for i in range(120)], joining, max_tokens=2)

    class SubmitsAtItsFirstToken(Collector):
        # Submitted from the scheduler's own thread at the running request's first token, so a busy machine
        # cannot let the running request finish before the long prompt arrives.
        def __call__(self, event) -> None:
            super().__call__(event)
            if len(self.texts) == 1 and not self.done.is_set():
                scheduler.submit(long_prompt)

    running = SubmitsAtItsFirstToken()
    job = Job([5, 6, 7], running, max_tokens=150, sampling=SamplingParams(temperature=1.0, seed=3))
    scheduler.submit(job)
    assert joining.first.wait(60)
    during = len(running.texts) - 1
    # 120 prompt tokens in chunks of 8: 15 turns, each with a decode step of the running request.
    assert during >= 10, f"the running stream produced only {during} deltas while a long prompt prefilled"
    scheduler.cancel(job)


def test_cancel_frees_the_place_and_keeps_the_prefix(tiny_llama, scheduler_for):
    scheduler = scheduler_for(tiny_llama, max_batch=1)
    first, second = Collector(), Collector()
    job = Job([9, 8, 7, 6], first, max_tokens=200, sampling=SamplingParams(temperature=1.0, seed=1))
    scheduler.submit(job)
    scheduler.submit(Job([1, 2, 3], second, max_tokens=3))
    assert first.first.wait(60)
    assert not second.done.is_set()  # one place: the second waits
    scheduler.cancel(job)
    assert first.wait().end.stats.finish_reason == "cancelled"
    assert isinstance(second.wait().end, Finished)
    assert first.end.stats.generated_tokens < 200
    assert no_pins(tiny_llama)


def test_queue_full_is_refused_with_a_retry_time(tiny_llama, scheduler_for):
    scheduler = scheduler_for(tiny_llama, max_batch=1, max_queue=1)
    long = Collector()
    job = Job([3, 4, 5], long, max_tokens=200, sampling=SamplingParams(temperature=1.0, seed=2))
    scheduler.submit(job)
    assert long.first.wait(60)
    queued = Collector()
    scheduler.submit(Job([3, 4], queued, max_tokens=2))
    with pytest.raises(BusyError) as refused:
        scheduler.submit(Job([3], Collector(), max_tokens=2))
    assert 1 <= refused.value.retry_after_s <= 60
    scheduler.cancel(job)
    assert isinstance(queued.wait().end, Finished)


def test_time_limit_ends_a_generation_as_length(tiny_llama, scheduler_for):
    scheduler = scheduler_for(tiny_llama)
    slow = Collector()
    job = Job([3, 4, 5], slow, max_tokens=250, sampling=SamplingParams(temperature=1.0, seed=4))

    def out_of_time_after_the_first_token(event):
        job.time_limit_s = 0.0  # runs on the scheduler's thread, before its next turn
        slow(event)

    job.on_event = out_of_time_after_the_first_token
    scheduler.submit(job)
    stats = slow.wait().end.stats
    assert stats.finish_reason == "length"
    assert 1 <= stats.generated_tokens <= 2


def test_time_limit_in_the_queue_fails_the_request(tiny_llama, scheduler_for):
    scheduler = scheduler_for(tiny_llama, max_batch=1)
    first = Collector()
    job = Job([3, 4], first, max_tokens=250, sampling=SamplingParams(temperature=1.0, seed=4))
    scheduler.submit(job)
    assert first.first.wait(60)
    late = Collector()
    scheduler.submit(Job([5, 6], late, max_tokens=2, time_limit_s=0.0))
    end = late.wait().end
    assert isinstance(end, Failed) and isinstance(end.error, RequestTimeoutError)
    scheduler.cancel(job)


def test_bad_requests_are_refused_before_queueing(tiny_llama, scheduler_for):
    scheduler = scheduler_for(tiny_llama)
    with pytest.raises(SamplingError, match="context"):
        scheduler.submit(Job([3] * 10, Collector(), max_tokens=250))  # fixture context: 256
    with pytest.raises(SamplingError, match="vocabulary"):
        scheduler.submit(Job([99999], Collector(), max_tokens=2))
    with pytest.raises(SamplingError, match="empty"):
        scheduler.submit(Job([], Collector(), max_tokens=2))
    with pytest.raises(SamplingError, match="stop"):
        Job([3], Collector(), stop=["x"] * 17)


def small_machine(total: int):
    """A machine of `total` bytes where all memory MLX does not hold is free (usable = total - 1 GiB headroom)."""

    def machine() -> MachineMemory:
        available = max(0, total - mx.get_active_memory() - mx.get_cache_memory())
        return MachineMemory(total, available, 0, "cpu", None, None)

    return machine


def test_requests_wait_for_memory_instead_of_failing(tiny_llama):
    from mlxinfer.memory import batch_peak_bytes

    # KV made 100 MB per row on paper, so the memory MLX itself holds cannot blur the line.
    footprint = dataclasses.replace(tiny_llama.footprint, kv_bytes=tiny_llama.footprint.kv_bytes * 2000)
    runtime = dataclasses.replace(tiny_llama.runtime, footprint=footprint)
    one = batch_peak_bytes(footprint, [3 + 200], 3, 256)
    two = batch_peak_bytes(footprint, [3 + 200, 3 + 200], 3, 256)
    assert two - one > 50 << 20
    budget = (1 << 30) + (one + two) // 2  # room for one
    scheduler = ServingThread(runtime, SchedulerConfig(max_batch=4), machine=small_machine(budget))
    timeline = []

    def recorder(name):
        collector = Collector()

        def record(event):
            timeline.append((name, type(event).__name__))
            collector(event)

        return collector, record

    try:
        (a, record_a), (b, record_b) = recorder("a"), recorder("b")
        params = SamplingParams(temperature=1.0, seed=5)
        scheduler.submit(Job([3, 4, 5], record_a, max_tokens=200, sampling=params))
        scheduler.submit(Job([6, 7, 8], record_b, max_tokens=200, sampling=params))
        assert isinstance(a.wait().end, Finished) and isinstance(b.wait().end, Finished)
        assert timeline.index(("a", "Finished")) < timeline.index(("b", "Delta"))  # b waited its turn
        assert b.end.stats.queued_s > 0
    finally:
        scheduler.stop()


def test_a_request_that_can_never_fit_fails_with_the_numbers(tiny_llama):
    scheduler = ServingThread(tiny_llama.runtime, machine=small_machine(1 << 30))  # nothing usable past headroom
    try:
        refused = Collector()
        scheduler.submit(Job([3, 4], refused, max_tokens=5))
        end = refused.wait().end
        assert isinstance(end, Failed) and isinstance(end.error, MemoryBudgetError)
        assert "GiB" in str(end.error)
    finally:
        scheduler.stop()


def one_running_one_waiting(scheduler: ServingThread) -> tuple[Collector, Collector]:
    """Two long requests on a one-place scheduler, returned once the first is decoding."""
    running, waiting = Collector(), Collector()
    params = SamplingParams(temperature=1.0, seed=6)
    scheduler.submit(Job([3, 4], running, max_tokens=250, sampling=params))
    scheduler.submit(Job([5, 6], waiting, max_tokens=250, sampling=params))
    assert running.first.wait(60)
    return running, waiting


def test_stop_ends_running_and_waiting_requests(tiny_llama):
    scheduler = ServingThread(tiny_llama.runtime, SchedulerConfig(max_batch=1))
    running, waiting = one_running_one_waiting(scheduler)
    scheduler.stop("going away")
    for collector in (running, waiting):
        end = collector.wait(10).end
        assert isinstance(end, Failed) and isinstance(end.error, ShutdownError)
    with pytest.raises(ShutdownError):
        scheduler.submit(Job([3], Collector(), max_tokens=2))
    assert no_pins(tiny_llama)


def test_abort_ends_what_runs_and_keeps_serving(tiny_llama, scheduler_for):
    scheduler = scheduler_for(tiny_llama, max_batch=1)
    running, waiting = one_running_one_waiting(scheduler)
    scheduler.abort("server stopping")
    for collector in (running, waiting):
        end = collector.wait(10).end
        assert isinstance(end, Failed) and "server stopping" in str(end.error)
    after = run_jobs(scheduler, [[7, 8]], max_tokens=3)[0]
    assert isinstance(after.end, Finished)
    assert no_pins(tiny_llama)


def test_a_listener_that_raises_does_not_stop_the_scheduler(tiny_llama, scheduler_for):
    scheduler = scheduler_for(tiny_llama)

    def broken(event):
        raise RuntimeError("listener bug")

    scheduler.submit(Job([3, 4], broken, max_tokens=3))
    fine = run_jobs(scheduler, [[5, 6]], max_tokens=3)[0]
    assert isinstance(fine.end, Finished) and fine.end.stats.generated_tokens >= 1


def test_scheduler_config_refuses_values_that_would_hang():
    from mlxinfer.errors import ConfigError

    for bad in ({"max_batch": 0}, {"max_queue": 0}, {"prefill_chunk": 0}, {"max_batch": True}):
        with pytest.raises(ConfigError):
            SchedulerConfig(**bad)


def test_a_failing_step_ends_its_requests_and_the_scheduler_goes_on(tiny_llama, scheduler_for, monkeypatch):
    scheduler = scheduler_for(tiny_llama)
    decoder = tiny_llama.runtime.decoder
    real = type(decoder).hidden
    calls = {"n": 0}

    def flaky(self, tokens, cache=None, images=None, shifts=None):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("device lost")
        return real(self, tokens, cache, images, shifts)

    monkeypatch.setattr(type(decoder), "hidden", flaky)
    broken = Collector()
    scheduler.submit(Job([3, 4], broken, max_tokens=3))
    end = broken.wait().end
    assert isinstance(end, Failed) and "device lost" in str(end.error)
    fine = Collector()
    scheduler.submit(Job([3, 4], fine, max_tokens=3))
    assert isinstance(fine.wait().end, Finished)
    assert no_pins(tiny_llama)


def test_batched_requests_share_the_prefix_cache(smol, scheduler_for):
    scheduler = scheduler_for(smol)
    system = [{"role": "system", "content": "You answer in one short sentence about geography."}]
    prompts = [
        smol.tokenizer.encode_chat(system + [{"role": "user", "content": q}])
        for q in ("What is the capital of Italy?", "What is the capital of Spain?")
    ]
    first = run_jobs(scheduler, prompts[:1], max_tokens=4)[0]
    second = run_jobs(scheduler, prompts[1:], max_tokens=4)[0]
    shared = next(i for i, (a, b) in enumerate(zip(*prompts)) if a != b)
    assert first.end.stats.prompt_tokens == len(prompts[0])
    assert second.end.stats.cached_tokens >= shared
    assert second.end.stats.prefilled_tokens == len(prompts[1]) - second.end.stats.cached_tokens
