"""A draft model's reading of the prompt: alongside the target's prefill, through its own prefix cache, counted
in the memory plan, and skipped by auto when the draft model is known to be too slow to pay."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import mlxinfer
from mlxinfer.engine import Job, SchedulerConfig
from mlxinfer.engine.drafting import DraftModel, DraftRuntime, PromptLookup
from mlxinfer.engine.job import Failed, Finished
from mlxinfer.engine.loop import BatchLoop
from mlxinfer.engine.sampling import SamplingParams
from mlxinfer.engine.speculation import (
    DRAFT_SLOWER,
    DRAFT_UNREAD,
    MARGIN,
    RETRY_DRAFT_MODEL,
    StepCosts,
    best_drafts,
    speculation_for,
)
from mlxinfer.engine.stats import GenerationStats
from mlxinfer.errors import MemoryBudgetError
from mlxinfer.memory import batch_peak_bytes
from tests.conftest import TINY
from tests.test_scheduler import small_machine

VOCAB = 272  # the tiny fixtures'


@pytest.fixture(scope="module")
def drafted():
    """The tiny llama drafting for itself (every draft kept), with room in its prefix caches."""
    return mlxinfer.load(TINY / "llama_classic", draft_model=TINY / "llama_classic", prefix_cache_bytes=64 << 20)


def prompt(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, VOCAB, n)]


def run(loop: BatchLoop, job: Job) -> list[Finished | Failed]:
    ends: list = []
    job.on_event = lambda event: ends.append(event) if isinstance(event, (Finished, Failed)) else None
    loop.add(job)
    while loop.has_work():
        loop.turn()
    return ends


def test_the_draft_model_reads_the_prompt_alongside_the_targets_prefill_and_drafts_at_once(drafted):
    loop = BatchLoop(drafted.runtime, SchedulerConfig(max_batch=2, prefill_chunk=48))
    ids = prompt(200, seed=1)
    progress, timeline = [], []
    prefill_step, step, verify = loop._prefill_step, loop.runner.batch.step, loop.runner.batch.verify

    def prefill_recorded():
        p = loop.runner.prefilling
        prefill_step()
        if loop.runner.prefilling is not None:  # (the last chunk hands the row to the batch)
            progress.append((p.run.cache[0].length, p.sequence.speculation.drafter.fed))

    loop._prefill_step = prefill_recorded
    loop.runner.batch.step = lambda *a, **k: timeline.append("plain") or step(*a, **k)
    loop.runner.batch.verify = lambda *a: timeline.append("verify") or verify(*a)
    (end,) = run(loop, Job(ids, None, max_tokens=12, speculate="draft", use_cache=False))
    assert isinstance(end, Finished)
    # Chunk by chunk together: the target (which leaves nothing cached here) and the draft model at each turn.
    assert progress == [(48, 48), (96, 96), (144, 144), (192, 192)]
    assert timeline[0] == "verify"  # the first decode step already verifies drafts: nothing left to read
    assert "plain" not in timeline
    plain = drafted.generate(ids, max_tokens=12, speculate="off", use_cache=False)
    assert end.stats.generated_tokens == len(plain.token_ids) and end.stats.accepted_tokens > 0


def test_the_draft_model_resumes_a_prompt_from_its_own_prefix_cache(drafted):
    draft_prefix = drafted.runtime.draft.prefix_cache
    first, follow_up = prompt(200, seed=2), prompt(40, seed=3)
    plain = drafted.generate(first + follow_up, max_tokens=10, speculate="off", use_cache=False)
    before = dataclasses.replace(draft_prefix.stats)
    drafted.generate(first, max_tokens=10, speculate="draft")  # reads all of it; keeps it at the end
    assert draft_prefix.stats.cached_tokens == before.cached_tokens
    again = drafted.generate(first + follow_up, max_tokens=10, speculate="draft")
    assert draft_prefix.stats.hits == before.hits + 1
    assert draft_prefix.stats.cached_tokens - before.cached_tokens >= len(first)  # it read only the rest
    assert again.token_ids == plain.token_ids and again.stats.drafted_tokens > 0


def test_a_request_that_keeps_no_prefixes_leaves_the_draft_models_prefix_cache_alone(drafted):
    draft_prefix = drafted.runtime.draft.prefix_cache
    before = dataclasses.replace(draft_prefix.stats)
    ids = prompt(100, seed=4)
    drafted.generate(ids, max_tokens=6, speculate="draft", use_cache=False)
    drafted.generate(ids, max_tokens=6, speculate="draft", use_cache=False)
    assert draft_prefix.stats.lookups == before.lookups and draft_prefix.stats.bytes_held == before.bytes_held


def learned(plain_s: float, per_position_s: float, draft_s: float | None) -> StepCosts:
    """Costs as auto learns them: one plain step, two verifications of 5 positions, the draft model's drafts."""
    costs = StepCosts()
    costs.add(1, plain_s, verified=False)
    for _ in range(2):
        costs.add(5, plain_s + 4 * per_position_s, verified=True)
    if draft_s is not None:  # the first proposal is not timed (one-off costs); two more are
        for _ in range(3):
            costs.add_draft(4, 4 * draft_s)
    return costs


# (plain step, each further position, a drafted token): a CPU where every position costs a step and the draft
# model costs what the target does; the same with a draft model 20x cheaper; a GPU where positions are nearly free.
CPU_SAME_SIZE, CPU_SMALL_DRAFT, GPU = (0.3, 0.3, 0.3), (0.3, 0.3, 0.015), (0.02, 0.0005, 0.002)


@pytest.mark.parametrize(
    "seconds, uses_model",
    [(CPU_SAME_SIZE, False), (CPU_SMALL_DRAFT, False), (GPU, True), ((0.3, 0.3, None), True)],
    ids=["cpu-same-size", "cpu-small-draft", "gpu", "draft-not-timed-yet"],
)
def test_auto_skips_a_draft_model_it_knows_cannot_pay_and_drafts_by_lookup(drafted, seconds, uses_model):
    plain_s, per_position_s, draft_s = seconds
    costs = learned(plain_s, per_position_s, draft_s)
    stats = GenerationStats()
    decoder, draft = drafted.runtime.decoder, drafted.runtime.draft
    speculation = speculation_for("auto", decoder, draft, [5, 6, 7], SamplingParams(), VOCAB, stats, costs)
    assert isinstance(speculation.drafter, DraftModel if uses_model else PromptLookup)
    assert stats.speculation == ("draft" if uses_model else "lookup")
    assert stats.draft_declined == ("" if uses_model else DRAFT_SLOWER)
    if draft_s is not None:  # the reference: expected tokens per second by hand, best over 1..12 drafts at 90% kept
        rate = max(
            sum(0.9**i for i in range(k + 1)) / (plain_s + per_position_s * k + k * draft_s) for k in range(1, 13)
        )
        assert (rate * plain_s >= MARGIN) == uses_model
        assert best_drafts((plain_s - per_position_s, per_position_s), 1, 0.9, draft_s)[1] == pytest.approx(
            rate * plain_s
        )
    # Asked for explicitly, the draft model drafts however slow.
    explicit = speculation_for("draft", decoder, draft, [5], SamplingParams(), VOCAB, stats, costs)
    assert isinstance(explicit.drafter, DraftModel)


def test_a_model_whose_draft_model_is_known_slow_answers_by_lookup_without_reading_the_prompt_twice(drafted):
    model = mlxinfer.load(TINY / "llama_classic", draft_model=TINY / "llama_classic", prefix_cache_bytes=64 << 20)
    model._step_costs = learned(*CPU_SAME_SIZE)
    draft_prefix = model.runtime.draft.prefix_cache
    ids = prompt(64, seed=5) * 3  # repeats itself: lookup has drafts
    result = model.generate(ids, max_tokens=20)
    assert result.stats.speculation == "lookup" and result.stats.draft_declined == DRAFT_SLOWER
    assert "draft model not used" in result.stats.summary()
    assert draft_prefix.stats.lookups == 0 and draft_prefix.stats.bytes_held == 0  # no reading, nothing kept
    assert result.token_ids == model.generate(ids, max_tokens=20, speculate="off").token_ids


def test_the_draft_models_cache_counts_in_the_memory_plan(drafted):
    runtime = drafted.runtime
    # The draft model's KV made 200 MB per row on paper, so the memory MLX itself holds cannot blur the line.
    big = dataclasses.replace(runtime.draft.footprint, kv_bytes=runtime.draft.footprint.kv_bytes * 4000)
    runtime = dataclasses.replace(runtime, draft=DraftRuntime(runtime.draft.decoder, None, big))
    ids, max_tokens, chunk = prompt(20, seed=6), 200, 64
    target = batch_peak_bytes(runtime.footprint, [len(ids) + max_tokens], len(ids), chunk)
    draft = big.cache_bytes(len(ids) + max_tokens, chunk)  # its own cache, a row's whole length
    assert draft > 100 << 20
    machine = small_machine((1 << 30) + target + draft // 2)  # room for the target's, not for both
    loop = BatchLoop(runtime, SchedulerConfig(max_batch=2, prefill_chunk=chunk), machine=machine)
    (plain,) = run(loop, Job(ids, None, max_tokens=max_tokens, speculate="off", use_cache=False))
    assert isinstance(plain, Finished)
    (refused,) = run(loop, Job(ids, None, max_tokens=max_tokens, speculate="draft", use_cache=False))
    assert isinstance(refused, Failed) and isinstance(refused.error, MemoryBudgetError)
    (lookup,) = run(loop, Job(ids, None, max_tokens=max_tokens, speculate="lookup", use_cache=False))
    assert isinstance(lookup, Finished)  # prompt lookup holds no second cache


def test_the_draft_model_times_two_proposals_after_the_first_before_auto_judges_it():
    costs = learned(*CPU_SAME_SIZE[:2], draft_s=None)
    costs.add_draft(4, 0.0)  # the first: not timed (it would say the draft model is free)
    costs.add_draft(4, 4 * 0.3)
    assert costs.draft_token_s() is None and costs.draft_model_pays()
    costs.add_draft(4, 4 * 0.3)
    assert costs.draft_token_s() == pytest.approx(0.3) and not costs.draft_model_pays()


def test_auto_times_a_draft_model_it_left_out_again_every_so_many_requests():
    costs = learned(*CPU_SAME_SIZE)
    assert costs.skips_draft_model(count=False) and costs.skips_draft_model(count=False)  # asking counts nothing
    skipped = [costs.skips_draft_model(count=True) for _ in range(2 * RETRY_DRAFT_MODEL)]
    assert [i + 1 for i, s in enumerate(skipped) if not s] == [RETRY_DRAFT_MODEL, 2 * RETRY_DRAFT_MODEL]


@pytest.mark.parametrize("name", ["qwen3_next", "gemma3_long"])  # recurrent layers; sliding windows of 4
def test_a_draft_model_with_uncuttable_layers_keeps_its_reading_for_the_next_turn(name):
    model = mlxinfer.load(TINY / name, draft_model=TINY / name, prefix_cache_bytes=64 << 20)
    draft_prefix = model.runtime.draft.prefix_cache
    first = prompt(60, seed=7)
    answer = model.generate(first, max_tokens=12, speculate="draft")
    assert answer.stats.accepted_tokens > 0  # (a draft was kept: its cache ends inside what was drawn)
    assert draft_prefix.stats.bytes_held > 0
    turn = first + answer.token_ids + prompt(20, seed=8)
    again = model.generate(turn, max_tokens=8, speculate="draft")
    assert draft_prefix.stats.hits == 1 and draft_prefix.stats.cached_tokens > len(first)
    assert again.token_ids == model.generate(turn, max_tokens=8, speculate="off", use_cache=False).token_ids


def test_auto_does_not_hold_the_first_token_for_a_draft_model_behind_the_targets_prefix_cache():
    model = mlxinfer.load(TINY / "llama_classic", draft_model=TINY / "llama_classic", prefix_cache_bytes=64 << 20)
    draft_prefix = model.runtime.draft.prefix_cache
    ids, chunk = prompt(200, seed=9), {"prefill_chunk_tokens": 64}
    plain = model.generate(ids, max_tokens=10, speculate="off", **chunk)  # the target's prefix cache has it
    late = model.generate(ids, max_tokens=10, speculate="auto", **chunk)
    assert late.stats.cached_tokens == len(ids) - 1 and late.stats.prefilled_tokens == 1
    assert late.stats.speculation == "lookup" and late.stats.draft_declined == DRAFT_UNREAD
    assert draft_prefix.stats.bytes_held > 0  # what it read in that one turn (64 tokens) is kept
    caught_up = [model.generate(ids, max_tokens=10, speculate="auto", **chunk) for _ in range(3)]
    # 64 more read at each (199 to read): behind twice more, then drafting with it.
    assert [r.stats.speculation for r in caught_up] == ["lookup", "lookup", "draft"]
    assert caught_up[-1].stats.drafted_tokens > 0
    for result in [late, *caught_up]:
        assert result.token_ids == plain.token_ids


def test_speculate_draft_waits_for_its_draft_model_to_read_what_the_target_resumed():
    model = mlxinfer.load(TINY / "llama_classic", draft_model=TINY / "llama_classic", prefix_cache_bytes=64 << 20)
    ids = prompt(200, seed=10)
    plain = model.generate(ids, max_tokens=10, speculate="off")
    result = model.generate(ids, max_tokens=10, speculate="draft", prefill_chunk_tokens=64)
    assert result.stats.cached_tokens == len(ids) - 1
    assert result.stats.speculation == "draft" and result.stats.drafted_tokens > 0
    assert result.token_ids == plain.token_ids


def test_a_warmed_prefix_is_read_into_the_draft_models_prefix_cache_too(drafted):
    draft_prefix = drafted.runtime.draft.prefix_cache
    system = prompt(120, seed=11)
    drafted.warm(system)
    hits = draft_prefix.stats.hits
    result = drafted.generate(system + prompt(10, seed=12), max_tokens=6, speculate="draft")
    assert draft_prefix.stats.hits == hits + 1 and result.stats.cached_tokens == len(system)
    assert draft_prefix.stats.cached_tokens >= len(system)
