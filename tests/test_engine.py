"""The generation loop: streaming, stop strings, EOS, chunked prefill, stats, seeds."""

from __future__ import annotations

import pytest

from mlxinfer.engine.text import StopMatcher
from mlxinfer.errors import SamplingError

PROMPT = "The quick brown fox"


def feed_all(stops, chunks):
    matcher = StopMatcher(stops)
    out = [matcher.feed(c) for c in chunks]
    return out, matcher


def test_stop_string_split_across_chunks_is_held_back_and_cut():
    out, matcher = feed_all(["STOP"], ["abc S", "TO", "P and more"])
    assert out == ["abc ", "", ""] and matcher.stopped


def test_false_start_of_a_stop_string_is_released():
    out, matcher = feed_all(["STOP"], ["abc ST", "ay"])
    assert "".join(out) == "abc STay" and not matcher.stopped


def test_earliest_of_several_stop_strings_wins():
    out, _ = feed_all(["world", "lo"], ["hello world"])
    assert out == ["hel"]


def test_streamed_text_equals_generated_text(tiny_llama):
    options = dict(max_tokens=24, temperature=1.0, seed=7)
    streamed = "".join(tiny_llama.stream(PROMPT, **options))
    assert streamed == tiny_llama.generate(PROMPT, **options).text
    assert len(streamed) > 0


def test_seeds_reproduce_and_differ(tiny_llama):
    run = lambda seed: tiny_llama.generate(PROMPT, max_tokens=16, temperature=1.5, seed=seed).token_ids  # noqa: E731
    assert run(1) == run(1)
    assert run(1) != run(2)


def test_stop_string_cuts_text_in_both_paths(tiny_llama):
    full = tiny_llama.generate(PROMPT, max_tokens=20).text
    stop = full[5:8]
    result = tiny_llama.generate(PROMPT, max_tokens=20, stop=[stop])
    assert result.text == full[: full.index(stop)]
    assert "".join(tiny_llama.stream(PROMPT, max_tokens=20, stop=stop)) == result.text
    assert result.finish_reason == "stop"


def test_eos_stops_generation_and_is_not_returned(tiny_llama):
    ids = tiny_llama.encode_prompt(PROMPT)
    free = tiny_llama.generate(ids, max_tokens=10).token_ids
    run = tiny_llama.stream(ids, max_tokens=10)
    run.request.eos_token_ids = {free[3]}
    list(run)
    assert run.ids == free[: free.index(free[3])]
    assert run.stats.finish_reason == "stop"


def test_max_tokens_and_stats(tiny_llama):
    result = tiny_llama.generate(PROMPT, max_tokens=5)
    stats = result.stats
    assert len(result.token_ids) == stats.generated_tokens == 5
    assert stats.finish_reason == "length"
    assert stats.prompt_tokens == len(tiny_llama.encode_prompt(PROMPT))
    assert stats.ttft_s > 0 and stats.prefill_tps > 0 and stats.decode_tps > 0 and stats.peak_memory_bytes > 0


def test_chunked_prefill_gives_the_same_tokens(tiny_llama):
    whole = tiny_llama.generate(PROMPT * 4, max_tokens=12).token_ids
    assert tiny_llama.generate(PROMPT * 4, max_tokens=12, prefill_chunk_tokens=3).token_ids == whole


@pytest.mark.parametrize(
    "options, words",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"temperature": float("nan")}, "temperature"),
        ({"stop": ["x"] * 40}, "stop"),
        ({"prefill_chunk_tokens": 0}, "prefill_chunk_tokens"),
        ({"nucleus": 0.5}, "unknown generation option"),
        ({"stop": 5}, "stop must be"),
    ],
)
def test_bad_generation_options(tiny_llama, options, words):
    with pytest.raises(SamplingError, match=words):
        tiny_llama.generate(PROMPT, **options)


def test_tiny_temperature_is_greedy_and_numpy_inputs_work(tiny_llama):
    import numpy as np

    ids = np.array(tiny_llama.encode_prompt(PROMPT))
    greedy = tiny_llama.generate(ids, max_tokens=6).token_ids
    assert tiny_llama.generate(ids, max_tokens=6, temperature=1e-45, seed=np.int64(3)).token_ids == greedy


def test_a_stream_runs_once(tiny_llama):
    run = tiny_llama.stream(PROMPT, max_tokens=3)
    list(run)
    with pytest.raises(SamplingError, match="already consumed"):
        list(run)


def test_token_ids_beyond_the_embedding_are_refused(tiny_llama):
    from mlxinfer.engine import GenerationRequest, GenerationStats, generate_ids

    request = GenerationRequest(prompt_ids=[1, 100_000], max_tokens=2)
    with pytest.raises(SamplingError, match="outside the model's vocabulary"):
        list(generate_ids(tiny_llama._loaded.model, request, GenerationStats()))


def test_bad_token_ids_are_refused(tiny_llama):
    with pytest.raises(SamplingError, match="token ids"):
        tiny_llama.logits([1, 99999])
    with pytest.raises(SamplingError, match="empty"):
        tiny_llama.generate("", max_tokens=3)
    with pytest.raises(SamplingError, match="chunk_tokens"):
        tiny_llama.logits([1, 2], chunk_tokens=0)
