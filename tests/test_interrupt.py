"""Ctrl-C (KeyboardInterrupt) in prefill or decode leaves the model and its caches ready for the next call."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlxinfer
from mlxinfer.models.decoder import DecoderLM
from mlxinfer.models.footprint import KV_GROUP_SIZE
from tests.conftest import TINY

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


def interrupt_in_layer(monkeypatch, model, layer: int, at: int) -> None:
    """Ctrl-C inside a forward pass: layer `layer` raises on its `at`-th call, the layers before it already ran."""
    target = model._loaded.model.layers[layer]
    real = type(target).__call__
    calls = {"n": 0}

    def flaky(self, *args, **kwargs):
        if self is target:
            calls["n"] += 1
            if calls["n"] == at:
                raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(target), "__call__", flaky)


SHORT = PROMPT[:60]  # chunks of 16: 16, 16, 16, 12


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory) -> Path:
    """The tiny llama with head_dim 64 (a quantized KV cache quantizes groups of 64 along it) and random weights."""
    folder = tmp_path_factory.mktemp("llama_head_dim_64")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(TINY / "llama_classic" / name, folder / name)
    config = json.loads((TINY / "llama_classic" / "config.json").read_text()) | {"head_dim": KV_GROUP_SIZE}
    (folder / "config.json").write_text(json.dumps(config))
    h, f, d = config["hidden_size"], config["intermediate_size"], KV_GROUP_SIZE
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], h)}
    layer = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
             "self_attn.o_proj": (h, q), "mlp.gate_proj": (f, h), "mlp.up_proj": (f, h),
             "mlp.down_proj": (h, f)}  # fmt: skip
    for i in range(config["num_hidden_layers"]):
        shapes.update({f"model.layers.{i}.{name}.weight": shape for name, shape in layer.items()})
    rng = np.random.default_rng(0)  # std 0.2, like the fixtures: greedy margins stay clear of rounding
    weights = {name: mx.array(rng.normal(0, 0.2, shape).astype(np.float32)) for name, shape in shapes.items()}
    norms = ["model.norm.weight"] + [f"model.layers.{i}.{n}.weight" for i in range(config["num_hidden_layers"])
                                     for n in ("input_layernorm", "post_attention_layernorm")]  # fmt: skip
    weights |= {name: mx.ones((h,)) for name in norms}
    # Tied embeddings: small rows for the special tokens (256 on, EOS among them) keep their logits near 0, far
    # below the likeliest token's, so the random model never ends its answer early.
    weights["model.embed_tokens.weight"][256:] *= 0.01
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    return folder


@pytest.fixture(params=[None, 8, 4], ids=["float-kv", "kv8", "kv4"])
def interrupted_model(request, tiny_llama) -> mlxinfer.Model:
    """The tiny llama, or (for a quantized KV cache, which needs head_dim 64) its wide-headed sibling."""
    if request.param is None:
        return tiny_llama
    return mlxinfer.load(request.getfixturevalue("wide_heads"), kv_bits=request.param)


@pytest.mark.parametrize(
    "where,at,kept",
    [
        ("hidden", 3, 32),  # the third chunk never ran: two chunks of 16
        ("__call__", 3, len(SHORT) + 2),  # the third decode step never ran: two answer tokens were fed back
        ("layer 1", 3, 32),  # layer 0 holds the third chunk, layer 1 does not: what both hold
        ("layer 1", 4 + 3, len(SHORT) + 2),  # 4 prefill chunks, then the third decode step, cut after layer 0
    ],
    ids=["prefill", "decode", "prefill-mid-forward", "decode-mid-forward"],
)
def test_interrupted_generation_keeps_what_every_layer_computed(interrupted_model, monkeypatch, where, at, kept):
    tiny_llama = interrupted_model
    tiny_llama.prefix_cache.clear()
    answer = tiny_llama.generate(SHORT, max_tokens=12, use_cache=False).token_ids
    assert len(answer) >= 3
    # Plain decoding: the steps counted below are one token each (a speculative step may emit several).
    run = tiny_llama.stream(SHORT, max_tokens=12, prefill_chunk_tokens=16, speculate="off")
    with monkeypatch.context() as patch:
        if where == "layer 1":
            interrupt_in_layer(patch, tiny_llama, 1, at)
        else:
            interrupt_on_call(patch, where, at)
        with pytest.raises(KeyboardInterrupt):
            for _ in run:
                pass
    assert run.ids == answer[: max(0, kept - len(SHORT))]
    assert run.stats.finish_reason == "cancelled"
    assert no_pins(tiny_llama)
    # The next turn extends the prompt and the cut answer: it reuses exactly what was computed, and the
    # kept keys and values are right: its greedy answer is the one computed without any cache.
    extended = SHORT + answer[:2] + [7, 8, 9]
    again = tiny_llama.generate(extended, max_tokens=8)
    assert again.stats.cached_tokens == kept
    assert again.token_ids == tiny_llama.generate(extended, max_tokens=8, use_cache=False).token_ids


def test_a_second_ctrl_c_while_keeping_the_prefix_still_stops(tiny_llama, monkeypatch):
    tiny_llama.prefix_cache.clear()
    answer = tiny_llama.generate(SHORT, max_tokens=12, use_cache=False).token_ids
    entries = tiny_llama.prefix_cache.stats.entries
    with monkeypatch.context() as patch:
        interrupt_on_call(patch, "__call__", 3)

        def second_ctrl_c(*args):
            raise KeyboardInterrupt  # pressed again while the interrupted run's keys and values are copied

        patch.setattr("mlxinfer.cache.prefix._copy_prefix", second_ctrl_c)
        with pytest.raises(KeyboardInterrupt):
            tiny_llama.generate(SHORT, max_tokens=12)
    assert no_pins(tiny_llama) and tiny_llama.prefix_cache.stats.entries == entries  # nothing half-added
    again = tiny_llama.generate(SHORT, max_tokens=12)
    assert again.token_ids == answer and again.stats.cached_tokens == 0
