"""The prompt-prefix cache: same tokens and logits with and without a hit, a byte budget that holds."""

from __future__ import annotations

import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner

import mlxinfer
from mlxinfer.cache import PrefixCache, make_cache
from mlxinfer.cli import main
from mlxinfer.engine import prefill
from mlxinfer.errors import ConfigError, SamplingError
from tests.conftest import TINY

PROMPT = list(range(40, 80))


def first_logits(model: mlxinfer.Model, ids: list[int], cache: PrefixCache | None) -> np.ndarray:
    """The logits that start decoding, prefilled from whatever `cache` holds."""
    hit = cache.lookup(ids) if cache else None
    kv = make_cache(model._loaded.model.cache_kinds)
    if hit:
        hit.restore(kv)
    start = hit.tokens if hit else 0
    logits = prefill(model._loaded.model, mx.array(ids[start:], dtype=mx.uint32), kv, chunk_tokens=7)
    if cache:
        cache.release(hit)
        cache.insert(ids, kv)
    return np.array(logits.astype(mx.float32))


def test_full_and_partial_hits_give_the_same_logits_and_tokens():
    model = mlxinfer.load(TINY / "qwen2")
    cold = {n: first_logits(model, PROMPT[:n], None) for n in (40, 30)}
    cache = PrefixCache(1 << 30)
    first_logits(model, PROMPT, cache)  # warm with the whole prompt
    np.testing.assert_allclose(first_logits(model, PROMPT, cache), cold[40], atol=2e-5)  # full hit (39 reused)
    np.testing.assert_allclose(first_logits(model, PROMPT[:30], cache), cold[30], atol=2e-5)  # a prefix of it
    assert cache.stats.hits == 2 and cache.stats.cached_tokens == 39 + 29

    uncached = model.generate(PROMPT, max_tokens=8, use_cache=False)
    model.generate(PROMPT[:25] + [1, 2, 3], max_tokens=4)  # diverges from PROMPT at 25
    partial = model.generate(PROMPT, max_tokens=8)
    assert partial.token_ids == uncached.token_ids
    assert partial.stats.cached_tokens == 25 and partial.stats.prefilled_tokens == 15
    assert partial.stats.diverged_at == 25
    again = model.generate(PROMPT, max_tokens=8)  # the previous answer's tokens are cached too
    assert again.token_ids == uncached.token_ids and again.stats.cached_tokens == 39


def test_hit_after_eviction_recomputes_the_same_answer():
    model = mlxinfer.load(TINY / "qwen2", prefix_cache_bytes=1)  # nothing fits: every request is cold
    uncached = model.generate(PROMPT, max_tokens=6, use_cache=False)
    assert model.generate(PROMPT, max_tokens=6).token_ids == uncached.token_ids
    assert model.cache_stats.entries == 0 and model.cache_stats.bytes_held == 0


def test_byte_budget_holds_under_distinct_prompts_and_evicts_least_recent():
    model = mlxinfer.load(TINY / "qwen2")
    entry = model.generate(list(range(3, 35)), max_tokens=1)  # one 32-token entry
    per_entry = model.cache_stats.bytes_held
    assert entry.stats.generated_tokens == 1 and per_entry > 0
    model.prefix_cache.set_budget(3 * per_entry)
    for start in range(50, 250, 20):  # ten distinct 32-token prompts
        model.generate(list(range(start, start + 32)), max_tokens=1)
        assert model.cache_stats.bytes_held <= 3 * per_entry
    stats = model.cache_stats
    assert stats.entries == 3 and stats.evictions >= 8
    assert model.generate(list(range(210, 242)), max_tokens=1).stats.cached_tokens == 31  # recent: kept
    evicted = model.generate(list(range(50, 82)), max_tokens=4)
    assert evicted.stats.cached_tokens == 0  # oldest: evicted, and recomputed the same
    assert evicted.token_ids == model.generate(list(range(50, 82)), max_tokens=4, use_cache=False).token_ids


def test_entries_in_use_are_never_evicted_and_shorter_turns_are_folded():
    model = mlxinfer.load(TINY / "qwen2")
    kv = make_cache(model._loaded.model.cache_kinds)
    prefill(model._loaded.model, mx.array(PROMPT, dtype=mx.uint32), kv, chunk_tokens=64)
    cache = PrefixCache(1 << 30)
    assert cache.insert(PROMPT[:20], kv) and cache.insert(PROMPT, kv)
    assert cache.stats.entries == 1  # the 20-token entry is a prefix of the 40-token one
    held = cache.lookup(PROMPT[:10] + [999])
    assert held is not None and held.tokens == 10 and held.diverged_at == 10
    cache.set_budget(0)
    assert cache.stats.entries == 1  # pinned by the running request
    cache.release(held)
    cache.set_budget(0)
    assert cache.stats.entries == 0 and cache.stats.bytes_held == 0
    assert cache.lookup(PROMPT) is None


def test_a_chat_turn_prefills_only_the_new_message(smol):
    history = [{"role": "user", "content": "What is the capital of France?"}]
    first = smol.chat(history, max_tokens=32)
    history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And of Italy?"}]
    second = smol.chat(history, max_tokens=16)
    uncached = smol.chat(history, max_tokens=16, use_cache=False)
    assert second.token_ids == uncached.token_ids
    assert second.stats.cached_tokens >= first.stats.prompt_tokens + first.stats.generated_tokens
    assert second.stats.prefilled_tokens <= 16  # the new user turn and the assistant header


@pytest.fixture
def prefix_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXINFER_CACHE_DIR", str(tmp_path))
    return tmp_path / "prefixes"


def test_a_warmed_prefix_survives_a_restart(prefix_dir):
    uncached = mlxinfer.load(TINY / "qwen2", prefix_cache_bytes=0).generate(PROMPT, max_tokens=8, use_cache=False)
    assert mlxinfer.load(TINY / "qwen2").warm(PROMPT[:30]) == 30
    restarted = mlxinfer.load(TINY / "qwen2")
    assert restarted.cache_stats.entries == 1 and restarted.cache_stats.bytes_held == 0  # KV stays on disk
    result = restarted.generate(PROMPT, max_tokens=8)
    assert result.token_ids == uncached.token_ids
    assert result.stats.cached_tokens == 30 and restarted.cache_stats.bytes_held > 0


def test_corrupt_and_foreign_files_are_quarantined_not_fatal(prefix_dir, caplog):
    mlxinfer.load(TINY / "qwen2").warm(PROMPT[:30])
    mlxinfer.load(TINY / "llama_classic").warm(PROMPT[:20])
    qwen_file, llama_file = sorted(prefix_dir.glob("*/*.safetensors"), key=lambda p: p.stat().st_size, reverse=True)
    truncated = qwen_file.read_bytes()[:-100]
    qwen_file.write_bytes(truncated)
    (qwen_file.parent / llama_file.name).write_bytes(llama_file.read_bytes())  # another model's KV
    model = mlxinfer.load(TINY / "qwen2")
    result = model.generate(PROMPT, max_tokens=4)
    assert result.stats.cached_tokens == 0
    assert result.token_ids == model.generate(PROMPT, max_tokens=4, use_cache=False).token_ids
    quarantined = sorted(p.name for p in (prefix_dir / "quarantine").iterdir())
    assert len(quarantined) == 2 and any(llama_file.name in name for name in quarantined)
    assert "ignoring prefix cache file" in caplog.text and "made for other weights" in caplog.text
    assert list(qwen_file.parent.glob("*.safetensors")) == []


def test_two_processes_warming_the_same_prefix_leave_one_whole_file(prefix_dir):
    code = f"import mlxinfer; mlxinfer.load({str(TINY / 'qwen2')!r}).warm({PROMPT!r})"
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    files = [p for p in prefix_dir.rglob("*") if p.is_file()]
    assert len(files) == 1 and files[0].suffix == ".safetensors"  # no temporary left behind
    model = mlxinfer.load(TINY / "qwen2")
    assert model.generate(PROMPT + [5], max_tokens=2).stats.cached_tokens == len(PROMPT)


def test_cache_commands_warm_list_and_clear(prefix_dir, tmp_path):
    text = tmp_path / "system.txt"
    text.write_text("You are a terse assistant.")
    runner = CliRunner()
    warmed = runner.invoke(main, ["cache", "warm", str(TINY / "qwen2"), "--prefix-file", str(text)])
    assert warmed.exit_code == 0 and "warmed" in warmed.output
    listed = runner.invoke(main, ["cache", "ls"])
    assert listed.exit_code == 0 and "qwen2" in listed.output and "1 warmed prefix " in listed.output
    cleared = runner.invoke(main, ["cache", "clear"])
    assert "removed 1 warmed prefix " in cleared.output and not list(prefix_dir.rglob("*.safetensors"))
    empty = tmp_path / "empty.txt"
    empty.write_text(" ")
    refused = runner.invoke(main, ["cache", "warm", str(TINY / "qwen2"), "--prefix-file", str(empty)])
    assert refused.exit_code != 0 and "is empty" in refused.output


@pytest.mark.parametrize("kv_bits", [8, 4])
def test_quantized_kv_cache_hits_match_cold_runs(smol_path, kv_bits):
    model = mlxinfer.load(smol_path, kv_bits=kv_bits)
    ids = model.encode_prompt("What is the capital of France?", chat=True)
    cold = model.generate(ids, max_tokens=8, use_cache=False)
    model.generate(ids[:20], max_tokens=1)
    hot = model.generate(ids, max_tokens=8)
    assert hot.token_ids == cold.token_ids and hot.stats.cached_tokens >= 20  # + the token it drew, if it matched
    float_kv = 30 * 3 * 64 * 2 * model.footprint.compute_bytes
    assert model.footprint.kv_bytes_per_token < float_kv * (0.3 if kv_bits == 8 else 0.17)
    if kv_bits == 8:
        assert model.tokenizer.decode(cold.token_ids).startswith("The capital of France is Paris")


def test_quantized_kv_is_refused_where_attention_cannot_read_it():
    with pytest.raises(ConfigError, match="gemma2 cannot use a quantized KV cache"):
        mlxinfer.load(TINY / "gemma2", kv_bits=8)
    with pytest.raises(ConfigError, match="kv_bits must be 4 or 8"):
        mlxinfer.load(TINY / "qwen2", kv_bits=3)


def test_an_entry_larger_than_the_budget_is_refused_without_touching_the_others():
    model = mlxinfer.load(TINY / "qwen2")
    small = model.generate(PROMPT[:10], max_tokens=1)
    per_token = model.cache_stats.bytes_held // (small.stats.prompt_tokens + 1)
    model.prefix_cache.set_budget(20 * per_token)
    model.generate(PROMPT, max_tokens=1)  # 41 tokens: over budget, refused before any copy
    assert model.cache_stats.entries == 1 and model.generate(PROMPT[:10] + [7], max_tokens=1).stats.cached_tokens == 10
    with pytest.raises(SamplingError, match="prefix to warm is empty"):
        model.warm("")
