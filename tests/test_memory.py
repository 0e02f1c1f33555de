"""The memory planner: predictions against measured peaks, verdicts, and requests that cannot fit."""

from __future__ import annotations

import dataclasses
import json

import pytest
from click.testing import CliRunner

import mlxinfer
from mlxinfer.cli import main
from mlxinfer.errors import MemoryBudgetError
from mlxinfer.memory import MachineMemory, ModelFootprint, apply_limits, plan_memory
from mlxinfer.memory.planner import RUNTIME_BYTES, MemoryPlan
from tests.conftest import TINY

GIB = 1 << 30


def machine(available: int, total: int = 4 * GIB, swap: int = 0) -> MachineMemory:
    return MachineMemory(total, available, swap, "cpu", None, None)


@pytest.mark.parametrize(("prompt", "chunk"), [(16, 8), (100, 32), (260, 512)])  # 260 crosses a KV growth step
def test_predicted_peak_is_within_ten_percent_of_the_measured_one(smol, prompt, chunk):
    ids = [100 + i % 900 for i in range(prompt)]
    result = smol.generate(ids, max_tokens=2, prefill_chunk_tokens=chunk, use_cache=False)
    predicted = smol.footprint.request_peak_bytes(prompt, prompt + 2, chunk) + smol.cache_stats.bytes_held
    measured = result.stats.peak_memory_bytes
    assert abs(predicted - measured) <= 0.10 * measured, (predicted, measured)


def test_kv_bytes_per_token_follow_the_config(smol):
    # SmolLM2-135M: 30 layers x 3 KV heads x 64 dims x (K and V) x float32 on the CPU backend
    expected = 30 * 3 * 64 * 2 * smol.footprint.compute_bytes
    assert smol.footprint.kv_bytes_per_token == expected
    assert smol.footprint.kv_cache_bytes(1) == smol.footprint.kv_cache_bytes(256) == 256 * expected


def test_verdicts_and_suggestions():
    model = mlxinfer.load(TINY / "qwen2", prefix_cache_bytes=0)
    roomy = plan_memory(machine(6 * GIB), model.footprint, context=4096, prefix_cache_bytes=0)
    assert roomy.verdict == "fits" and roomy.suggestions() == []
    assert roomy.max_context() == 256  # the fixture's max_position_embeddings: never more than it was trained for
    tight = plan_memory(machine(GIB + 64 * 2**20 + 20 * 2**20), model.footprint, context=200_000, prefix_cache_bytes=0)
    assert tight.verdict in ("does not fit", "fits but risks swap")
    assert 0 < tight.max_context() < 200_000
    assert any(f"at most {tight.max_context()} tokens" in tip for tip in tight.suggestions())
    with pytest.raises(MemoryBudgetError, match=r"200000 tokens need .* GiB.*use a context of at most"):
        tight.check()
    assert plan_memory(machine(6 * GIB, swap=2 * GIB), model.footprint, 4096, prefix_cache_bytes=0).verdict == (
        "fits but risks swap"
    )


def plan_with_kv_steps(steps: int, context: int, trained: int | None) -> MemoryPlan:
    """A model whose every byte is counted by hand: no weights, 2 KV bytes a position (1 layer, 1 KV head of
    1 dim, K and V, 1 byte each), grown 256 positions at a time; one-token prefill chunks keep 4 bytes of
    temporaries (q of 0 heads, k and v: 2 x 2 x 1 byte); room for exactly `steps` KV growth steps."""
    footprint = ModelFootprint(0, 1, 1, 1, 0, 0, 0, 0, compute_bytes=1, kv_bytes=1.0, max_positions=trained)
    usable = RUNTIME_BYTES + steps * 256 * 2 + 4
    return MemoryPlan(machine(GIB), footprint, context, 1, usable, prefix_cache_bytes=0)


LIMITS = [
    # memory fits 100 steps of 256 positions: 25600 tokens
    (100, 1000, None, "memory is the limit: the largest context that fits is 25600 tokens"),
    (100, 1000, 32768, "memory is the limit: the largest context that fits is 25600 tokens"),
    (100, 65536, 32768, "memory is the limit: the largest context that fits is 25600 tokens; 65536 is also past "
     "the model's trained limit of 32768 tokens (max_position_embeddings; `serve` refuses longer requests)"),
    # memory fits 32 steps, 8192 tokens: all the model was trained for
    (32, 8192, 8192, "the model's trained limit is 8192 tokens (max_position_embeddings), and memory allows all of it"),
    (32, 32768, 8192, "the model's trained limit is 8192 tokens (max_position_embeddings); 32768 is past it "
     "(`serve` refuses longer requests)"),
    # no trained limit, memory for 2**16 steps (2**24 tokens): the search stops at 2**24, memory did not stop it
    (1 << 16, 1000, None, "memory allows at least 16777216 tokens, as far as the plan looks (the model states no "
     "limit)"),
]  # fmt: skip


@pytest.mark.parametrize(("steps", "context", "trained", "expected"), LIMITS)
def test_the_context_limit_names_every_limit_that_applies(steps, context, trained, expected):
    plan = plan_with_kv_steps(steps, context, trained)
    assert plan.context_limit() == expected


def test_a_request_that_cannot_fit_is_refused_and_a_tight_one_is_rechunked(monkeypatch):
    model = mlxinfer.load(TINY / "qwen2", prefix_cache_bytes=0)
    headroom = GIB  # MachineMemory keeps at least 1 GiB for the rest of the machine
    monkeypatch.setattr("mlxinfer.api.machine_memory", lambda: machine(headroom + 70 * 2**20))
    # What this test process already holds (other tests' models, MLX's buffer cache) would count as ours.
    monkeypatch.setattr("mlxinfer.api.mx.get_active_memory", lambda: model.footprint.weights_bytes)
    monkeypatch.setattr("mlxinfer.api.mx.get_cache_memory", lambda: 0)
    with pytest.raises(MemoryBudgetError, match="use a context of at most"):
        model.generate(list(range(3, 200)), max_tokens=500_000)
    long_prompt = [3 + i % 250 for i in range(2000)]  # one 2000-token chunk's attention scores alone: 128 MiB
    run = model.stream(long_prompt, max_tokens=2, prefill_chunk_tokens=2000)
    assert 16 <= run.request.prefill_chunk_tokens < 2000  # halved until it fit
    assert len(list(run)) > 0
    assert run.ids == model.generate(long_prompt, max_tokens=2, prefill_chunk_tokens=64, use_cache=False).token_ids


def test_plan_command_prints_a_table_and_json():
    result = CliRunner().invoke(main, ["plan", str(TINY / "qwen2"), "--context", "2048"])
    assert result.exit_code == 0, result.output
    assert "kv cache" in result.output and "verdict: fits" in result.output
    data = json.loads(CliRunner().invoke(main, ["plan", str(TINY / "qwen2"), "--context", "2048", "--json"]).output)
    assert data["context"] == 2048 and data["parts"]["kv cache"] > 0 and data["verdict"] == "fits"


def test_plan_with_quantized_kv_needs_less_kv_memory(smol_path):
    runner = CliRunner()
    plans = [
        json.loads(runner.invoke(main, ["plan", str(smol_path), "--context", "8192", "--json", *extra]).output)
        for extra in ([], ["--kv-bits", "8"])
    ]
    assert plans[1]["parts"]["kv cache"] < 0.3 * plans[0]["parts"]["kv cache"]
    assert plans[1]["max_context"] >= plans[0]["max_context"]


def test_limits_wire_only_what_the_model_needs_on_metal(monkeypatch):
    model = mlxinfer.load(TINY / "qwen2", prefix_cache_bytes=0)
    calls = {}
    monkeypatch.setattr("mlxinfer.memory.limits.mx.set_wired_limit", lambda n: calls.setdefault("wired", n))
    monkeypatch.setattr("mlxinfer.memory.limits.mx.set_cache_limit", lambda n: calls.setdefault("cache", n))
    mac = MachineMemory(16 * GIB, 10 * GIB, 0, "metal", working_set_bytes=11 * GIB, max_buffer_bytes=8 * GIB)
    plan = plan_memory(mac, model.footprint, context=4096, prefix_cache_bytes=0)
    limits = apply_limits(plan)
    assert calls["wired"] == limits["wired_limit"] == plan.parts["weights"] + plan.parts["kv cache"]
    assert calls["cache"] == limits["cache_limit"] >= 256 << 20
    huge = dataclasses.replace(model.footprint, weights_bytes=20 * GIB)
    calls.clear()
    apply_limits(plan_memory(mac, huge, context=4096, prefix_cache_bytes=0))
    assert calls["wired"] == int(0.7 * 11 * GIB)  # never the whole working set
    calls.clear()
    apply_limits(plan_memory(machine(6 * GIB), model.footprint, context=4096, prefix_cache_bytes=0))
    assert "wired" not in calls  # nothing to wire on the CPU backend
