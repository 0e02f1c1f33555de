"""Ctrl-C (KeyboardInterrupt) in prefill or decode leaves the model and its caches ready for the next call."""

from __future__ import annotations

import pytest

from mlxinfer.models.decoder import DecoderLM

PROMPT = [(i * 37) % 250 + 3 for i in range(150)]


def interrupt_on_call(monkeypatch, method: str, at: int) -> None:
    real = getattr(DecoderLM, method)
    calls = {"n": 0}

    def flaky(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == at:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(DecoderLM, method, flaky)


def no_pins(model) -> bool:
    return all(entry.pins == 0 for entry in model.prefix_cache._entries.values())


@pytest.mark.parametrize("method,at", [("hidden", 2), ("__call__", 3)], ids=["prefill", "decode"])
def test_interrupted_generation_leaves_everything_usable(tiny_llama, monkeypatch, method, at):
    tiny_llama.prefix_cache.clear()
    expected = tiny_llama.generate(PROMPT, max_tokens=12, use_cache=False)
    tiny_llama.generate(PROMPT[:100], max_tokens=2)  # a cached prefix the interrupted run will pin
    with monkeypatch.context() as patch:
        interrupt_on_call(patch, method, at)
        with pytest.raises(KeyboardInterrupt):
            tiny_llama.generate(PROMPT, max_tokens=12, prefill_chunk_tokens=16)
    assert no_pins(tiny_llama)
    again = tiny_llama.generate(PROMPT, max_tokens=12)
    assert again.token_ids == expected.token_ids
    assert again.stats.cached_tokens >= 100  # the prefix cache still serves what it held
