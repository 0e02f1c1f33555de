"""Every layer kind: bounded sliding windows, recurrent state, prefix snapshots and batched rows.

Each check compares against a run that cannot share the code under test's shortcut: a cold run (no prefix
cache), a single-chunk forward (no window regrowth), or each sequence alone (no batch).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mlxinfer
from mlxinfer.cache import StateCache, make_cache
from mlxinfer.cache.batch import add_row, drop_rows, row_cache
from mlxinfer.cache.kv import STEP
from tests.conftest import HYBRID, TINY

PROMPT = list(range(40, 80))
WINDOWED = ["gemma2", "gemma3_long", "gpt_oss"]


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 256, n).tolist()


@pytest.mark.slow
@pytest.mark.parametrize("arch", WINDOWED)
def test_a_window_keeps_only_what_later_queries_see_and_matches_a_single_forward(arch):
    model = mlxinfer.load(TINY / arch)
    lm = model._loaded.model
    ids = tokens(2 * STEP + 100, seed=1)
    whole = model.logits(ids, chunk_tokens=len(ids))  # one chunk: every key present, the window only masked
    np.testing.assert_allclose(model.logits(ids, chunk_tokens=37), whole, atol=1e-4)
    cache = make_cache(lm.cache_kinds)
    for i in range(len(ids)):  # one token at a time: the window regrows and drops what it no longer needs
        logits = lm(mx.array([[ids[i]]]), cache)[0, -1]
        np.testing.assert_allclose(np.array(logits), whole[i], atol=1e-4, err_msg=f"position {i}")
    window = lm.layout.sliding_window
    for kind, c in zip(lm.layout.layer_types, cache):
        held = c.arrays[0].shape[2]
        if kind == "sliding_attention":
            assert c.length - c.start < window + STEP and held <= window + 2 * STEP, (c.start, held)
        else:
            assert c.start == 0 and held >= len(ids)


@pytest.mark.slow
@pytest.mark.parametrize("arch", HYBRID)
def test_a_shared_prefix_resumes_from_the_deepest_snapshot_and_matches_a_cold_run(arch):
    model = mlxinfer.load(TINY / arch)
    cold = model.generate(PROMPT, max_tokens=8, use_cache=False)
    model.generate(PROMPT[:25] + [1, 2, 3], max_tokens=4, snapshot_every=8)  # snapshots at 8, 16, 24, 27, 28...
    partial = model.generate(PROMPT, max_tokens=8, snapshot_every=8)
    assert partial.token_ids == cold.token_ids
    # 25 tokens are shared, but these layers cannot be cut back: the deepest snapshot within them is at 24.
    assert partial.stats.cached_tokens == 24 and partial.stats.prefilled_tokens == 16
    assert "shares 25 tokens" in partial.stats.cache_note and "snapshot" in partial.stats.cache_note
    again = model.generate(PROMPT, max_tokens=8)  # the position before the prompt's end is a snapshot
    assert again.token_ids == cold.token_ids and again.stats.cached_tokens == len(PROMPT) - 1
    # A chat's next turn: the state after the answer (all 8 tokens were fed back) is a snapshot too.
    turn = PROMPT + cold.token_ids + [5, 6]
    longer = model.generate(turn, max_tokens=4)
    assert longer.stats.cached_tokens == len(PROMPT) + 8
    assert longer.token_ids == model.generate(turn, max_tokens=4, use_cache=False).token_ids


@pytest.mark.slow
@pytest.mark.parametrize("arch", HYBRID)
def test_rows_of_every_kind_decode_batched_as_they_do_alone(arch):
    """Teacher-forced rows join and leave a batch; each row's logits equal that sequence run alone,
    past the point where sliding windows regrow (STEP positions)."""
    lm = mlxinfer.load(TINY / arch)._loaded.model
    prompts = [tokens(20, seed=2), tokens(STEP + 30, seed=3), tokens(7, seed=4)]
    windowed = "sliding_attention" in lm.layout.layer_types
    feed = tokens(STEP + 20 if windowed else 40, seed=5)  # the same forced tokens for every row

    def prefilled(prompt):
        cache = make_cache(lm.cache_kinds)
        lm(mx.array([prompt]), cache)
        return cache

    alone = [prefilled(p) for p in prompts]
    batch = add_row(add_row(None, prefilled(prompts[0])), prefilled(prompts[1]))
    rows = [0, 1]
    for step, token in enumerate(feed):
        if step == 5:  # a third sequence joins mid-way
            batch, rows = add_row(batch, prefilled(prompts[2])), rows + [2]
        if step == len(feed) // 2:  # the first leaves
            batch, rows = drop_rows(batch, [0]), rows[1:]
        got = lm(mx.array([[token]] * len(rows)), batch)[:, -1]
        for i, row in enumerate(rows):
            want = lm(mx.array([[token]]), alone[row])[0, -1]
            np.testing.assert_allclose(np.array(got[i]), np.array(want), atol=2e-4, err_msg=f"row {row} step {step}")
    single = row_cache(batch, 0, lm.cache_kinds, None)  # row 1, as a single sequence for the prefix cache
    want = lm(mx.array([[3]]), alone[1])[0, -1]
    np.testing.assert_allclose(np.array(lm(mx.array([[3]]), single)[0, -1]), np.array(want), atol=2e-4)


def test_a_recurrent_state_moves_only_when_the_layer_finishes_its_step():
    # A forward stopped between two slot writes (Ctrl-C) must not leave one slot a step ahead of the other.
    cache = StateCache()
    cache[0], cache[1] = mx.ones((1, 2)), mx.ones((1, 3))
    cache.advance(4)
    cache[0] = mx.zeros((1, 2))  # the next step wrote its first slot, then was interrupted
    assert cache.length == 4 and cache[0].sum().item() == 2 and cache.snapshot()[0].sum().item() == 2


def test_an_edited_conversation_resumes_at_the_end_of_the_last_unchanged_message():
    model = mlxinfer.load(TINY / "lfm2")
    system = {"role": "system", "content": "You are terse."}
    first = [system, {"role": "user", "content": "hello there friend"}]
    model.chat(first, max_tokens=4)
    edited = [system, {"role": "user", "content": "something else entirely"}]
    system_ids = model.tokenizer.encode_chat([system], add_generation_prompt=False)
    end_of_turn = next(i for i, t in enumerate(system_ids) if t in model.eos_token_ids) + 1
    result = model.chat(edited, max_tokens=4)
    assert result.stats.cached_tokens == end_of_turn  # the state after the system message's end is a snapshot
    assert result.token_ids == model.chat(edited, max_tokens=4, use_cache=False).token_ids


@pytest.mark.parametrize("bits", [None, 8])
def test_a_window_returns_the_same_recent_keys_as_a_full_cache(bits):
    """Position by position, a windowed cache (float or quantized) hands attention the same last window of
    keys and values as a cache that keeps everything, while holding a bounded number of positions."""
    window, kinds = 8, [("full_attention", None), ("sliding_attention", 8)]
    full, sliding = make_cache(kinds, kv_bits=bits)
    rng = np.random.default_rng(6)
    for step in range(2 * STEP + 40):
        new = 1 if step % 5 else 7  # decode steps with a few prefill chunks in between
        keys, values = (mx.array(rng.standard_normal((1, 2, new, 64)).astype(np.float32)) for _ in range(2))
        start = sliding.key_start(new)
        got, want = sliding.update_and_fetch(keys, values), full.update_and_fetch(keys, values)
        assert start == sliding.start and sliding.length == full.length
        for a, b in zip(_flat(got), _flat(want)):
            np.testing.assert_array_equal(np.array(a[..., -window:, :]), np.array(b[..., -window:, :]))
        assert sliding.arrays[0].shape[2] <= window + 2 * STEP  # the window, a chunk, one step of slack
    assert sliding.nbytes < full.nbytes / 2


def _flat(pair):
    keys, values = pair
    return [*keys, *values] if isinstance(keys, tuple) else [keys, values]


@pytest.mark.parametrize("arch", ["lfm2", "gemma3_long"])
def test_a_prompt_that_leaves_a_cached_one_snapshots_there_for_the_next(arch):
    model = mlxinfer.load(TINY / arch)
    shared = PROMPT[:30]
    model.generate(shared + [1, 2, 3], max_tokens=2, snapshot_every=1000)
    second = model.generate(shared + [7, 8, 9], max_tokens=2, snapshot_every=1000)
    assert second.stats.cached_tokens == 0  # no snapshot within the 30 shared tokens yet: said, not silent
    assert "shares 30 tokens" in second.stats.cache_note and "no state snapshot" in second.stats.cache_note
    third = model.generate(shared + [5, 5, 5], max_tokens=2, snapshot_every=1000)
    assert third.stats.cached_tokens == 30  # the second took a snapshot where it left the first
    assert third.token_ids == model.generate(shared + [5, 5, 5], max_tokens=2, use_cache=False).token_ids


def test_snapshot_positions_are_bounded_whatever_the_spacing_asked():
    from mlxinfer.engine.prefill import MAX_MESSAGE_MARKS, MAX_SPACED_SNAPSHOTS, snapshot_positions

    assert snapshot_positions(0, 40, 8) == [8, 16, 24, 32, 39, 40]  # a short prompt: as asked
    stops = snapshot_positions(0, 1_000_000, 1, marks=range(0, 1_000_000, 3)[-MAX_MESSAGE_MARKS:])
    assert len(stops) <= MAX_SPACED_SNAPSHOTS + MAX_MESSAGE_MARKS + 2


def test_a_cache_sized_for_its_prompt_prefills_into_one_allocation(monkeypatch):
    """A request's full-attention caches make room for its prompt at once (engine/runner.py), so chunks past each
    STEP write into the storage the first one made instead of copying the history; the logits are an unsized
    cache's (which grows step by step)."""
    import mlxinfer.engine.runner as runner

    model = mlxinfer.load(TINY / "llama_classic")
    lm, ids = model._loaded.model, mx.array([tokens(3 * STEP + 10, seed=5)])
    sized, grown = make_cache(lm.cache_kinds, positions=ids.shape[1]), make_cache(lm.cache_kinds)
    storage = []
    for start in range(0, ids.shape[1], 100):
        chunk = ids[:, start : start + 100]
        np.testing.assert_allclose(np.array(lm(chunk, sized)), np.array(lm(chunk, grown)), atol=1e-5)
        storage.append(id(sized[0].arrays[0]))
    assert len(set(storage)) == 1 and sized[0].arrays[0].shape[2] == 3 * STEP + STEP  # one allocation, rounded
    assert grown[0].arrays[0].shape[2] == sized[0].arrays[0].shape[2]  # the same room in the end, by four copies
    made = []
    monkeypatch.setattr(runner, "make_cache", lambda *args, **kw: made.append(kw) or make_cache(*args, **kw))
    model.generate(PROMPT, max_tokens=2, use_cache=False)
    assert made == [{"positions": len(PROMPT) + 1}]
