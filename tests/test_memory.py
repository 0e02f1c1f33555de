"""The memory planner: predictions against measured peaks and real caches, verdicts, requests that cannot fit."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil

import mlx.core as mx
import pytest
from click.testing import CliRunner
from safetensors import safe_open

import mlxinfer
from mlxinfer.cache import StateCache, make_cache
from mlxinfer.cli import main
from mlxinfer.engine.prefill import Prefill
from mlxinfer.errors import MemoryBudgetError
from mlxinfer.memory import MachineMemory, ModelFootprint, apply_limits, plan_memory
from mlxinfer.memory.planner import RUNTIME_BYTES, MemoryPlan
from mlxinfer.models.registry import ARCHITECTURES
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
    monkeypatch.setattr("mlxinfer.engine.admission.machine_memory", lambda: machine(headroom + 70 * 2**20))
    # What this test process already holds (other tests' models, MLX's buffer cache) would count as ours.
    monkeypatch.setattr("mlxinfer.api.mx.get_active_memory", lambda: model.footprint.weights_bytes)
    monkeypatch.setattr("mlxinfer.api.mx.get_cache_memory", lambda: 0)
    with pytest.raises(MemoryBudgetError, match=r"needs .* GiB but .* GiB can be used; lower max_tokens"):
        model.generate(list(range(3, 200)), max_tokens=500_000)
    long_prompt = [3 + i % 250 for i in range(2000)]  # one 2000-token chunk's attention scores alone: 128 MiB
    run = model.stream(long_prompt, max_tokens=2, prefill_chunk_tokens=2000)
    assert len(list(run)) > 0
    assert 16 <= run.stats.prefill_chunk < 2000  # halved until it fit
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


def prefilled(model: mlxinfer.Model, tokens: int, chunk: int) -> list:
    """The real caches of `model` after a `tokens`-token prompt prefilled `chunk` at a time."""
    decoder = model._loaded.model
    caches = make_cache(decoder.cache_kinds, model.kv_bits)
    Prefill.start(decoder, caches, mx.array([3 + i % 250 for i in range(tokens)], dtype=mx.uint32), chunk).run()
    return caches


def held_by_type(model: mlxinfer.Model, caches: list) -> dict[str, int]:
    held = {}
    for (kind, _), cache in zip(model._loaded.model.cache_kinds, caches):
        held[kind] = held.get(kind, 0) + cache.nbytes
    return held


@pytest.mark.slow
def test_sliding_layers_stop_growing_and_the_planner_counts_what_the_caches_hold():
    # tests/fixtures/tiny/gemma3: 5 sliding layers (window 8) + 1 full, 2 KV heads x 16 dims, float32.
    model = mlxinfer.load(TINY / "gemma3", prefix_cache_bytes=0)
    f = model.footprint
    assert (f.full_layers, f.sliding_layers, f.window, f.recurrent_layers) == (1, 5, 8, 0)
    position = 2 * 2 * 16 * 4  # K and V x 2 heads x 16 dims x float32, one layer
    held = {tokens: held_by_type(model, prefilled(model, tokens, chunk=64)) for tokens in (1300, 2600)}
    # cache/kv.py: a window keeps its last 7 positions plus a 64-token chunk, in 256-position steps plus a step
    assert held[1300]["sliding_attention"] == held[2600]["sliding_attention"] == 5 * 512 * position
    assert held[1300]["full_attention"] == 1536 * position and held[2600]["full_attention"] == 2816 * position
    for tokens, kinds in held.items():
        assert f.sliding_kv_bytes(tokens, 64) == kinds["sliding_attention"]
        assert f.full_kv_bytes(tokens) == kinds["full_attention"]
        assert f.kv_cache_bytes(tokens, 64) == sum(kinds.values())
    assert f.kv_bytes_per_token == position  # only the full layer grows


@pytest.mark.parametrize(("name", "sliding", "full"), [("gemma3", 5, 1), ("gemma2", 2, 2), ("gpt_oss", 2, 2)])
def test_plan_shows_the_bound_of_the_sliding_layers(name, sliding, full):
    runner = CliRunner()
    result = runner.invoke(main, ["plan", str(TINY / name), "--context", "4096"])
    assert result.exit_code == 0, result.output
    # window 8, prefill chunk 512: 7 + 512 positions in 256-position steps, plus a step of slack
    grows = "grows" if full == 1 else "grow"
    mib = f"{full * 4096 * 256 / 2**20:.1f} MiB"
    assert f"KV cache: {sliding} sliding layers (window 8) bounded at 1024 positions" in result.output
    assert f"{full} full layer{'s' if full > 1 else ''} {grows} ({mib} at 4096 tokens)" in result.output
    data = json.loads(runner.invoke(main, ["plan", str(TINY / name), "--context", "4096", "--json"]).output)
    layers = data["layers"]
    assert (layers["sliding_layers"], layers["full_layers"], layers["sliding_positions"]) == (sliding, full, 1024)
    assert data["parts"]["kv cache"] == (sliding * 1024 + full * 4096) * 256


# bfloat16 where the CPU backend runs it (its GatherMM, which MoE layers use, is float32 only): qwen3_5 keeps
# a float32 recurrent state next to a bfloat16 convolution state.
RECURRENT_FIXTURES = [("lfm2", None), ("lfm2", "bfloat16"), ("qwen3_next", None), ("qwen3_5", None),
                      ("qwen3_5", "bfloat16"), ("granitemoehybrid", None)]  # fmt: skip


@pytest.mark.parametrize(("name", "dtype"), RECURRENT_FIXTURES)
def test_recurrent_state_is_counted_as_the_caches_hold_it(name, dtype):
    config = json.loads((TINY / name / "config.json").read_text())
    if config["model_type"] not in ARCHITECTURES:
        pytest.skip(f"{config['model_type']} is not supported yet")
    model = mlxinfer.load(TINY / name, prefix_cache_bytes=0, dtype=dtype)
    f = model.footprint
    recurrent = [kind for kind in config["layer_types"] if kind not in ("full_attention", "sliding_attention")]
    assert f.recurrent_layers == len(recurrent) > 0
    short, long = prefilled(model, 40, chunk=16), prefilled(model, 300, chunk=64)
    for tokens, caches in ((40, short), (300, long)):
        states = [c for c in caches if isinstance(c, StateCache)]
        assert f.state_bytes == sum(c.nbytes for c in states) > 0, tokens
        assert f.kv_cache_bytes(tokens, 64) + f.state_bytes >= sum(c.nbytes for c in caches)
    decoder = model._loaded.model
    for _ in range(3):  # decode steps keep the state's size
        decoder(mx.array([[5]], dtype=mx.uint32), short)
    assert f.state_bytes == sum(c.nbytes for c in short if isinstance(c, StateCache))


def test_plan_shows_the_recurrent_state():
    result = CliRunner().invoke(main, ["plan", str(TINY / "lfm2"), "--context", "4096"])
    assert result.exit_code == 0, result.output
    # lfm2 fixture: 2 conv layers keeping the last 2 inputs of 64 channels in float32 (conv_L_cache 3)
    assert "2 recurrent layers: 1.0 KiB of state per sequence" in result.output
    assert "KV cache: 2 full layers grow" in result.output


def bounded_footprint(**changes) -> ModelFootprint:
    """4 sliding layers (window 16) and 2 recurrent ones with 1000 bytes of state; 1 KV head of 1 dim, 1 byte."""
    sizes = dict(full_layers=0, sliding_layers=4, window=16, recurrent_layers=2, state_bytes=1000)
    sizes.update(changes)
    return ModelFootprint(0, kv_heads=1, head_dim=1, heads=0, hidden=0, intermediate=0, vocab=0, compute_bytes=1,
                          kv_bytes=1.0, **sizes)  # fmt: skip


def test_a_model_whose_caches_do_not_grow_has_no_context_limit_from_memory():
    f = bounded_footprint()
    # one-position chunks: 15 + 1 positions in one 256-position step, plus a step of slack; K and V: 2 bytes
    assert f.kv_cache_bytes(1 << 20, chunk=1) == f.kv_cache_bytes(300, chunk=1) == 4 * 512 * 2
    assert f.cache_bytes(1 << 20, chunk=1) == 4 * 512 * 2 + 1000
    usable = RUNTIME_BYTES + 4 * 512 * 2 + 1000 + 10  # the caches and one chunk's temporaries
    untrained = MemoryPlan(machine(GIB), f, 1 << 20, 1, usable, prefix_cache_bytes=0)
    assert untrained.parts["recurrent state"] == 1000
    assert untrained.max_context() == 1 << 24
    assert untrained.context_limit() == (
        "no layer's cache grows with the context, so memory sets no limit on it (the model states no limit)"
    )
    trained = MemoryPlan(machine(GIB), dataclasses.replace(f, max_positions=8192), 4096, 1, usable, 0)
    assert trained.max_context() == 8192
    assert untrained.cache_lines() == [
        "KV cache: 4 sliding layers (window 16) bounded at 512 positions (4.0 KiB), no layer grows with the context",
        "2 recurrent layers: 1.0 KiB of state per sequence",
    ]
    # one full layer makes memory the limit again
    growing = MemoryPlan(machine(GIB), bounded_footprint(full_layers=1), 1 << 20, 1, usable, 0)
    assert growing.max_context() < 1 << 20


def test_the_kv_memory_bench_measures_a_bound_that_holds():
    from bench.kv_memory import AttentionShape, held_bytes, run_kv_memory_bench

    shape = AttentionShape("tiny", layers=6, sliding_every=6, window=64, kv_heads=1, head_dim=16, dtype=mx.float16)
    after = {context: held_bytes(shape.kinds(), shape, context) for context in (2048, 4096)}
    assert after[2048]["sliding_attention"] == after[4096]["sliding_attention"]  # bounded at the window
    assert after[4096]["full_attention"] == 2 * after[2048]["full_attention"]
    # window 64, chunk 512: 63 + 512 positions in 256-position steps plus a step, K and V x 16 dims x float16
    assert after[2048]["sliding_attention"] == 5 * 1024 * 2 * 16 * 2
    assert held_bytes(shape.kinds(), shape, 2048, every_layer=True) == after[2048]  # one per kind is enough
    before = held_bytes(shape.kinds(windows=False), shape, 4096)
    assert before == {"full_attention": 6 * after[4096]["full_attention"]}
    figures = run_kv_memory_bench(shape, contexts=(2048, 4096))
    assert all(row["planned_bytes"] == row["measured_bytes"] for row in figures["rows"])  # the planner agrees
    assert figures["ratios"]["4096"] == before["full_attention"] / sum(after[4096].values())


def test_limits_count_every_loaded_model_until_it_is_gone(monkeypatch):
    import gc

    from mlxinfer.memory import hold_limits

    wired = []
    monkeypatch.setattr("mlxinfer.memory.limits.mx.set_wired_limit", wired.append)
    monkeypatch.setattr("mlxinfer.memory.limits.mx.set_cache_limit", lambda n: None)
    mac = MachineMemory(64 * GIB, 40 * GIB, 0, "metal", working_set_bytes=48 * GIB, max_buffer_bytes=8 * GIB)
    model = mlxinfer.load(TINY / "qwen2", prefix_cache_bytes=0)
    plans = [plan_memory(mac, model.footprint, context=c, prefix_cache_bytes=0) for c in (1024, 4096)]
    need = [p.parts["weights"] + p.parts["kv cache"] for p in plans]

    class Owner:  # stands in for a loaded Model: the limits follow its lifetime
        pass

    gc.collect()  # models other tests left behind would otherwise leave (and set the limits) in between
    first, second = Owner(), Owner()
    hold_limits(first, plans[0])  # other models loaded in this process count too: compare differences
    with_first = wired[-1]
    hold_limits(second, plans[1])
    assert wired[-1] == with_first + need[1]  # the second model does not unwire the first
    del second
    gc.collect()
    assert wired[-1] == with_first  # set again from the models still loaded
    del first


# ---- mixture of experts: every expert resident, decode reads only the routed ones ----
MOE_FIXTURES = ["gpt_oss", "qwen3_next", "granitemoehybrid"]
# Routed experts as transformers saves them (per expert or stacked) and as mlx-lm's converter writes them;
# qwen3_next's `shared_expert.` and Granite's `shared_mlp.` are dense: read in full by every token.
ROUTED = re.compile(r"\.experts\.|\.switch_mlp\.|block_sparse_moe\.(input|output)_linear\.")


def stored_shapes(folder) -> dict[str, tuple[int, ...]]:
    """Every weight tensor's shape, from the safetensors headers."""
    shapes = {}
    for path in sorted(folder.glob("model*.safetensors")):
        with safe_open(str(path), "numpy") as f:
            shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
    return shapes


def expected_moe_bytes(folder) -> tuple[int, int, int]:
    """(weights, routed experts, read per decoded token) in float32 bytes, from config.json and the headers alone:
    a token reads num_experts_per_tok of each layer's num_experts routed experts, and everything else."""
    config = json.loads((folder / "config.json").read_text())
    experts = config.get("num_experts") or config["num_local_experts"]
    shapes = stored_shapes(folder)
    total = 4 * sum(math.prod(s) for s in shapes.values())  # float32 floats, uint32 packed words: 4 bytes each
    routed = 4 * sum(math.prod(s) for name, s in shapes.items() if ROUTED.search(name))
    return total, routed, total - routed + routed * config["num_experts_per_tok"] // experts


@pytest.mark.parametrize("name", MOE_FIXTURES)
def test_moe_decode_reads_only_the_active_experts_and_plan_says_so(name):
    total, routed, decoded = expected_moe_bytes(TINY / name)
    f = mlxinfer.load(TINY / name, dtype="float32", prefix_cache_bytes=0).footprint
    assert (f.weights_bytes, f.expert_bytes, f.decode_weights_bytes) == (total, routed, decoded)
    assert 0 < decoded < total  # every expert resident, half of them (2 of 4) read per token
    result = CliRunner().invoke(main, ["plan", str(TINY / name), "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    assert f"experts: 4, 2 active per token: decode reads {decoded / 1e3:.3g} KB of {total / 1e3:.3g} KB" in (
        result.output
    )
    data = json.loads(CliRunner().invoke(main, ["plan", str(TINY / name), "--dtype", "float32", "--json"]).output)
    assert data["decode_weights_bytes"] == decoded and data["weights_bytes"] == data["parts"]["weights"] == total
    assert data["experts"] == {"experts": 4, "experts_per_token": 2, "expert_bytes": routed,
                               "active_expert_bytes": routed // 2}  # fmt: skip


def test_quantized_experts_count_their_packed_bits_and_scales(tmp_path):
    from mlxinfer.convert import convert

    out = tmp_path / "q4"
    convert(TINY / "qwen3_next", out, bits=4, dtype="float32", evaluate=False, progress=False)
    total, routed, decoded = expected_moe_bytes(out)
    assert any(name.endswith("switch_mlp.up_proj.scales") for name in stored_shapes(out))
    f = mlxinfer.load(out, dtype="float32", prefix_cache_bytes=0).footprint
    assert (f.weights_bytes, f.expert_bytes, f.decode_weights_bytes) == (total, routed, decoded)


def test_a_dense_model_reads_all_its_weights_and_plans_no_experts():
    data = json.loads(CliRunner().invoke(main, ["plan", str(TINY / "qwen2"), "--json"]).output)
    assert data["experts"] is None and data["decode_weights_bytes"] == data["weights_bytes"] > 0
    assert "experts:" not in CliRunner().invoke(main, ["plan", str(TINY / "qwen2")]).output


@pytest.mark.parametrize("name", [*MOE_FIXTURES, "qwen3_moe"])  # qwen3_moe: layer 1 is dense (mlp_only_layers)
def test_the_config_counts_every_expert_weight_the_checkpoint_holds(name):
    from mlxinfer.models.config import normalize_config
    from mlxinfer.models.sizing import moe_layout

    config = normalize_config(json.loads((TINY / name / "config.json").read_text()))
    moe = moe_layout(config)
    hidden = config.hidden_size
    # gate, up and down matrices of every routed expert in every MoE layer (their biases are not counted)
    matrices = [s for n, s in stored_shapes(TINY / name).items() if ROUTED.search(n) and not n.endswith("bias")]
    assert len(moe.sparse_layers) * moe.experts * 3 * hidden * moe.expert_width == sum(math.prod(s) for s in matrices)


def test_a_config_whose_expert_count_is_not_the_checkpoints_is_refused_before_building(tmp_path):
    from mlxinfer.errors import WeightMismatchError

    shutil.copytree(TINY / "gpt_oss", tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "num_local_experts": 8}))
    with pytest.raises(WeightMismatchError, match=r"num_local_experts is 8 but model\.layers\.0\.mlp\.router\.weight"):
        mlxinfer.load(tmp_path / "m")


@pytest.mark.parametrize("name", ["gemma4", "deepseek_v3", "qwen2", "afmoe"])
def test_the_kv_per_position_is_what_the_widest_layers_cache_holds(name):
    # Gemma 4's global layers are wider than its sliding ones, DeepSeek's caches hold the expanded latent
    # attention, afmoe runs unverified: the config's head sizes would miss each.
    from mlxinfer.models.footprint import footprint

    model = mlxinfer.load(TINY / name, dtype="float32")
    decoder = model._loaded.model
    caches = make_cache(decoder.cache_kinds)
    mx.eval(decoder.hidden(mx.array([list(range(3, 7))], dtype=mx.uint32), caches))
    held = [sum(a.nbytes for a in c.state) // c.length for c in caches if not isinstance(c, StateCache)]
    assert footprint(model._loaded).kv_bytes_per_position == max(held)


def test_on_cuda_the_plan_is_bounded_by_the_gpus_free_memory(monkeypatch):
    """A discrete GPU holds the weights: its free memory (MLX's device_info), not the host's, bounds the plan."""
    from mlxinfer.memory import machine

    gpu_free = 3 * 2**30
    monkeypatch.setattr(machine.mx.metal, "is_available", lambda: False)
    monkeypatch.setattr(machine.mx.cuda, "is_available", lambda: True)
    monkeypatch.setattr(machine.mx, "device_info", lambda: {"total_memory": 8 * 2**30, "free_memory": gpu_free})
    memory = machine.machine_memory()
    assert memory.backend == "cuda" and memory.working_set_bytes == gpu_free
    assert memory.usable_bytes() == min(gpu_free, memory.available_bytes - memory.headroom_bytes)
