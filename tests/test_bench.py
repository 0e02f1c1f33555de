"""The benchmark harness: units, `mlxinfer bench`, and one `python -m bench --quick` run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from mlxinfer.cli import main
from mlxinfer.speed.bandwidth import ceiling_tps, kv_bytes_per_token
from mlxinfer.speed.measure import Spread
from mlxinfer.speed.report import markdown
from mlxinfer.speed.suite import prompt_ids
from mlxinfer.tokenizer import Tokenizer
from tests.conftest import TINY

ROOT = Path(__file__).resolve().parents[1]
MODEL = TINY / "llama_classic"


def test_spread_and_ceiling_arithmetic():
    assert Spread.of([3.0, 1.0, 2.0]) == Spread(2.0, 1.0, 3.0)
    # 2 layers x (K and V) x 2 KV heads x head_dim 16 x 4 bytes
    assert kv_bytes_per_token(MODEL, 4) == 2 * 2 * 2 * 16 * 4
    assert ceiling_tps(100.0, weights_bytes=10**9, kv_bytes=10**6, context_tokens=1000) == pytest.approx(50.0)


def test_prompt_ids_are_real_text_of_the_requested_length():
    tok = Tokenizer.from_folder(MODEL)
    ids = prompt_ids(tok, 3000)
    assert len(ids) == 3000
    assert tok.decode(ids[:40]).startswith("It is a truth universally acknowledged")


def test_cli_bench_compares_engines_on_the_same_files():
    args = ["bench", str(MODEL), "--compare", "--json", "--prompt-tokens", "8", "--decode-tokens", "3", "--runs", "2"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    rows = report["results"]
    assert [(r["engine"], r["mode"]) for r in rows] == [
        ("mlxinfer", "default"),
        ("mlx-lm", "default"),
        ("mlx-lm", "matched"),
    ]
    for r in rows:
        assert r["prompt_tokens"] == 8 and r["decode_tokens"] == 3 and 1 <= r["warm_runs"] <= 2
        assert r["decode_tps"]["min"] <= r["decode_tps"]["median"] <= r["decode_tps"]["max"]
        assert r["peak_rss_bytes"] > r["weights_bytes"] > 0 and r["engine_overhead"] > 0
    assert rows[2]["compute_dtype"] == rows[0]["compute_dtype"]
    assert rows[0]["quantization"] is None  # the tiny fixture is unquantized
    assert report["conditions"]["versions"]["mlx-lm"] and report["conditions"]["cores"]
    assert "mlxinfer / mlx-lm (matched" in markdown(report)


def test_cli_bench_refuses_gguf_comparison(tmp_path):
    fake = tmp_path / "m.gguf"
    fake.write_bytes(b"GGUF")
    result = CliRunner().invoke(main, ["bench", str(fake), "--compare"])
    assert result.exit_code == 1 and "mlx-lm cannot load GGUF" in result.output


def test_quick_harness_writes_json_markdown_and_plots(tmp_path, smol_hf, default_cache):
    # smol_hf: the bf16 checkpoint in the cache, where the harness finds it instead of making it with transformers.
    # --quick is a smoke run of the whole harness on the real model: one 4-bit variant, a 2-token prompt, 4 tokens,
    # mlx-lm in our dtype only (its bf16 default, a token a second here, runs in the CLI test above).
    env = {**os.environ, "MLXINFER_CACHE_DIR": str(default_cache)}
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(next(tmp_path.glob("*-quick.json")).read_text())
    rows = report["results"]
    assert [(r["engine"], r["mode"]) for r in rows] == [("mlxinfer", "default"), ("mlx-lm", "matched")]
    assert rows[1]["compute_dtype"] == rows[0]["compute_dtype"]
    assert report["settings"]["prompt_tokens"] == 2 and report["bandwidth"]["best_gbps"] > 0
    assert all(r["prompt_tokens"] == 2 and r["decode_tokens"] == 4 and r["warm_runs"] == 1 for r in rows)
    assert rows[0]["quantization"]["group_size"] == 64
    # Both engines read the same files: the converter figures' mlx-lm output, kept as the cached 4-bit model.
    four_bit = default_cache / "bench-models" / "SmolLM2-135M-Instruct-4bit"
    assert {r["model"] for r in rows} == {str(four_bit)} and (four_bit / "config.json").is_file()
    for png in ("decode", "prefill"):
        assert next(tmp_path.glob(f"*-quick-{png}.png")).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = next(tmp_path.glob("*-quick.md")).read_text()
    assert (
        "decode" in table and "4-bit: mlxinfer / mlx-lm (matched" in table and "mlxinfer (uniform, 4-bit g64)" in table
    )
    converters = [r["converter"] for r in report["convert"]["rows"]]
    assert converters[0].startswith("mlx-lm") and converters[1].startswith("mlxinfer")
    assert report["convert"]["eval_tokens"] == 8 and report["convert"]["source"] == str(smol_hf)


def test_hybrid_bench_quick_runs_the_tiny_hybrids_through_both_engines(tmp_path):
    # The real run (`python -m bench --hybrid-only`) measures torch-made, realistically shaped checkpoints;
    # --quick sends the committed tiny fixtures through the same code (no torch needed).
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--hybrid-only", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(next(tmp_path.glob("*-quick-hybrid.json")).read_text())
    assert figures["conditions"]["versions"]["mlx-lm"] and figures["conditions"]["cores"]
    assert figures["models"]["lfm2"]["layer_types"] == {"conv": 2, "full_attention": 2}
    prefix = figures["settings"]["prefix_tokens"]
    rows = {r["how"]: r for r in figures["shared_prefix"]["rows"]}
    # With snapshots every 32 tokens or a warmed prefix, the second request resumes exactly at the shared 64.
    for how in ("after a request, snapshot_every=32", "after model.warm(prefix)"):
        assert rows[how]["cached_tokens"] == prefix and rows[how]["prefilled_tokens"] == 16, rows[how]
        assert f"resumed at {prefix}" in rows[how]["cache_note"]
    decode = {r["family"]: r for r in figures["decode"]}
    for family in ("lfm2", "gemma3_text"):
        ours, theirs = decode[family]["mlxinfer"], decode[family]["mlx-lm"]
        assert ours["decode_tps"] > 0 and theirs["decode_tps"] > 0
        # Both engines compute the same model from the same weights: the same greedy tokens, as many of them.
        assert decode[family]["same_tokens"] and ours["generated_tokens"] == theirs["generated_tokens"] > 1
    table = next(tmp_path.glob("*-quick-hybrid.md")).read_text()
    assert "| lfm2 |" in table and "| gemma3_text |" in table and "cached tokens" in table


def test_moe_bench_quick_converts_and_decodes_the_tiny_moe_with_both_engines(tmp_path):
    # The real run (`python -m bench --moe-only`) builds a shaped bf16 checkpoint with transformers; --quick sends
    # the committed tiny fixture through the same code: two conversions, each in its own process, then decoding.
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--moe-only", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(next(tmp_path.glob("*-quick-moe.json")).read_text())
    assert figures["conditions"]["versions"]["mlx-lm"] and figures["conditions"]["cores"]
    assert figures["settings"]["bits"] == 4 and figures["settings"]["prompt_tokens"] == 24
    assert [r["converter"] for r in figures["convert"]] == ["mlx-lm", "mlxinfer"]
    assert all(r["wall_s"] > 0 and r["peak_rss_bytes"] > 0 for r in figures["convert"])
    assert len(figures["decode"]) == 2  # the source files and mlx-lm's 4-bit output, both engines on each
    for row in figures["decode"]:
        ours, theirs = row["mlxinfer"], row["mlx-lm"]
        assert ours["decode_tps"] > 0 and theirs["decode_tps"] > 0
        assert row["same_tokens"] and ours["generated_tokens"] == theirs["generated_tokens"] > 1
        # Both engines hold the experts alike: a token reads the same bytes (2 of 4 experts) of either.
        assert row["decode_weights_bytes"] == row["mlx_lm_decode_weights_bytes"] < row["weights_bytes"]
    ratios = figures["ratios"]
    peak = figures["convert"][1]["peak_rss_bytes"] / figures["convert"][0]["peak_rss_bytes"]
    assert ratios["convert_peak_rss"] == pytest.approx(peak)
    assert f"converter peak RSS, mlxinfer / mlx-lm: {peak:.2f}x (goal: at most 0.5x" in done.stdout
    assert done.stdout.count("mlxinfer / mlx-lm: ") == 3  # the converter's and each decode row's ratio


def test_mlx_lm_acceptance_is_read_from_its_from_draft_flags():
    from bench.speculative_bench import draft_stats

    # mlx-lm, 3 drafts a step, 8 tokens: kept 2 then its own token; kept 3 then its own; the last step drafts the
    # one token left, kept, and max_tokens ends it before a token of the target's own.
    flags = [True, True, False, True, True, True, False, True]
    assert draft_stats(flags, max_tokens=8, k=3) == {"drafted": 3 + 3 + 1, "accepted": 6, "steps": 3, "emitted": 8}


def test_speculative_bench_quick_runs_every_configuration_on_both_engines(tmp_path):
    # The tiny fixture drafting for itself: greedy drafts from the target's own weights are all kept, and every
    # configuration must decode the plain tokens (mlx-lm's plain tokens being the reference for ours).
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--speculative-only", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(next(tmp_path.glob("*-quick-speculative.json")).read_text())
    assert figures["conditions"]["versions"]["mlx-lm"] and figures["settings"]["chat_tokens"] == 8
    for task in ("grounded", "chat"):
        t = figures["tasks"][task]
        configs = [(r["engine"], r["config"]) for r in t["rows"]]
        assert configs == [("mlxinfer", c) for c in ("off", "auto", "auto + draft model", "lookup", "draft")] + [
            ("mlx-lm", "plain"),
            ("mlx-lm", "draft model"),
        ]
        assert t["same_tokens_across_engines"] and all(r["same_tokens_as_plain"] for r in t["rows"])
        assert all(r["generated_tokens"] == [8] and r["decode_tps"] > 0 for r in t["rows"])
        drafted = [r for r in t["rows"] if r["config"] in ("draft", "draft model")]
        assert [r["acceptance_rate"] for r in drafted] == [1.0, 1.0]
        assert t["rows"][1]["cached_tokens"] == [t["prompt_tokens"] - 1]  # later rows resume from the prefix cache
        assert t["draft_read_s"] > 0
    assert [r["positions"] for r in figures["step_costs"]["rows"]] == [1, 2, 3, 5, 9]
    table = next(tmp_path.glob("*-quick-speculative.md")).read_text()
    assert "| mlx-lm | draft model |" in table and "by positions fed" in table


def test_the_held_out_texts_are_three_kinds_none_of_them_calibration():
    """bench/heldout_bench.py's texts: code, technical prose and a chat in the model's template, all long enough
    for its 512 tokens, and none taken from the calibration or quality-report text."""
    import mlxinfer
    from bench.heldout_bench import texts
    from mlxinfer.data import prose_text

    model = mlxinfer.load(TINY / "llama_classic")
    kinds = texts(model)
    assert list(kinds) == ["code", "technical prose", "chat"] and all(len(ids) >= 512 for ids in kinds.values())
    im_start = next(i for i, text in model.tokenizer.special_ids.items() if text == "<|im_start|>")
    assert kinds["chat"].count(im_start) == 16  # the system message, 14 turns and the reply it prompts
    calibration = (Path(mlxinfer.__file__).parent / "data" / "calibration.txt").read_text()
    for kind in ("code", "technical prose"):
        sample = model.tokenizer.decode(kinds[kind][100:140])
        assert sample not in calibration and sample not in prose_text(), kind


@pytest.mark.slow
def test_peer_recipes_bench_runs_mlx_lms_learned_recipes_on_our_calibration(tmp_path):
    # The real run scores SmolLM2-135M (bench/README.md); here the tiny fixture goes through the same code: our
    # mixed calibration ids, each mlx-lm recipe in a child process, mlx-lm's save, our held-out scoring.
    done = subprocess.run(
        [sys.executable, "-m", "bench.peer_recipes_bench", "--source", str(TINY / "qwen2"), "--tokens", "64",
         "--calibration-tokens", "512", "--dwq-steps", "2", "--dwq-batch-size", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "calibration: 512 mixed tokens, 2 x 256 used; DWQ 2 steps x 1 sequences" in done.stdout
    rows = {line.split(" | ")[0]: line for line in done.stdout.splitlines() if line.startswith("| ")}
    assert set(rows) == {"| recipe", "| awq", "| dwq (lr 1e-06, 2 steps)", "| dynamic_quant"}, done.stdout
    for name in ("| awq", "| dynamic_quant"):
        bits = float(rows[name].split(" | ")[1])
        assert 4.0 < bits < 5.5, rows[name]  # 4-bit g64 (5-bit layers for dynamic_quant), on a tiny model


@pytest.mark.slow
def test_forecast_bench_copies_a_gguf_and_measures_each_conversion(tmp_path):
    # The real run measures SmolLM2-135M (bench/README.md, "Converter peaks"); here the tiny llama as Q8_0 GGUF.
    import gguf
    import mlx.core as mx
    import numpy as np

    import mlxinfer
    from bench.forecast_bench import write_gguf_copy
    from tests.test_gguf import write_tiny_gguf

    q8 = write_tiny_gguf(tmp_path / "tiny.gguf", k_quant="model.layers.0.mlp.down_proj.weight",
                         k_type=gguf.GGMLQuantizationType.Q8_0)  # fmt: skip
    f16 = write_gguf_copy(q8, tmp_path / "f16.gguf", "F16")
    kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(f16)).tensors}
    assert kinds["blk.0.ffn_down.weight"] == "F16" and kinds["blk.0.attn_norm.weight"] == "F32"
    ids = mx.array([[1, 5, 9, 13]])
    original, copy = (mlxinfer.load(path)._loaded.model(ids) for path in (q8, f16))
    np.testing.assert_allclose(np.array(copy), np.array(original), rtol=2e-2, atol=2e-2)  # F16's rounding
    done = subprocess.run(
        [sys.executable, "-m", "bench.forecast_bench", "--gguf", str(q8), "--no-copies", "--cases", "8bit"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split(" | ") for line in done.stdout.splitlines() if line.startswith("| tiny.gguf")]
    assert len(rows) == 1 and rows[0][1:3] == ["8bit", "`--bits 8 --no-eval`"], done.stdout
    assert int(rows[0][3]) > 0 and int(rows[0][4]) > 0  # the plan line's forecast and the result line's peak


def test_a_synthetic_k_quant_llama_holds_its_type_and_runs(tmp_path):
    # forecast_bench's stand-in for K and IQ files: every matrix of the type, values of the intended spread.
    import gguf
    import numpy as np

    import mlxinfer
    from bench.forecast_bench import SYNTHETIC, WEIGHT_STD, write_synthetic_gguf
    from tests.test_gguf import write_tiny_gguf

    sizes = {**SYNTHETIC, "embedding_length": 256, "feed_forward_length": 512, "block_count": 1}
    sizes |= {"attention.head_count": 4, "attention.head_count_kv": 2}
    path = write_synthetic_gguf(write_tiny_gguf(tmp_path / "t.gguf"), tmp_path / "s.gguf", "Q3_K", sizes)
    tensors = gguf.GGUFReader(str(path)).tensors
    matrices = [t for t in tensors if len(t.shape) == 2]
    assert len(matrices) == 8 and {t.tensor_type.name for t in matrices} == {"Q3_K"}
    values = gguf.quants.dequantize(matrices[0].data, gguf.GGMLQuantizationType.Q3_K)
    assert 0.5 * WEIGHT_STD < values.std() < 2 * WEIGHT_STD
    assert np.isfinite(mlxinfer.load(path).logits([1, 2, 3])).all()


@pytest.mark.slow
def test_kquant_bench_compares_each_weights_mode_with_the_gguf_packages_values(tmp_path):
    import gguf

    from tests.test_gguf import write_tiny_gguf

    names = ["model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.up_proj.weight"]
    path = write_tiny_gguf(tmp_path / "tiny.gguf", k_quants=dict.fromkeys(names, gguf.GGMLQuantizationType.Q8_0))
    done = subprocess.run(
        [sys.executable, "-m", "bench.kquant_bench", "--gguf", str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {r[1].split(" (")[0]: r for r in (line.split(" | ") for line in done.stdout.splitlines()) if len(r) > 8}
    assert set(rows) >= {"quantized", "auto", "reference"}, done.stdout
    assert rows["quantized"][4].endswith("MiB") and float(rows["quantized"][3].rstrip("x")) > 0
    # Q8_0 is held as its own codes: the logits equal the gguf package's dequantized model's.
    assert float(rows["quantized"][6]) < 1e-4 and rows["quantized"][8].startswith("100%"), rows["quantized"]


@pytest.mark.slow
def test_a_configuration_reports_its_progress_and_time_left_as_it_runs():
    from mlxinfer.speed.measure import RunSpec
    from mlxinfer.speed.runner import run_one

    heard: list[str] = []
    spec = RunSpec("mlxinfer", str(MODEL), "float", "default", None, list(range(3, 11)), decode_tokens=3, runs=2)
    result = run_one(spec, 600, heard.append)
    assert result.warm_runs == 2 and heard[0].startswith("loaded in ") and len(heard) == 3
    assert re.fullmatch(r"run 1 of 2: [0-9.]+ tok/s, about [0-9]+ s left", heard[1])
    assert heard[2].startswith("run 2 of 2: ")


def test_mlx_lms_quantized_default_on_a_cpu_says_why_it_is_slow(monkeypatch):
    import mlx.core as mx

    from mlxinfer.speed import runner
    from mlxinfer.speed.measure import RunSpec

    spec = RunSpec("mlx-lm", str(MODEL), "4-bit", "default", None, [3], decode_tokens=1)
    monkeypatch.setattr(runner.mx, "default_device", lambda: mx.cpu)
    assert "without BLAS on a CPU" in runner.slow_note(spec)
    assert runner.slow_note(RunSpec("mlx-lm", str(MODEL), "4-bit", "matched", None, [3], decode_tokens=1)) == ""
    monkeypatch.setattr(runner.mx, "default_device", lambda: mx.gpu)
    assert runner.slow_note(spec) == ""


@pytest.mark.slow
def test_adapter_bench_runs_every_stream_each_way_and_counts_the_adapters():
    from bench.adapter_bench import ADAPTERS, STREAMS, measure

    result = measure(TINY / "llama_classic", rank=4, decode=4)
    for run in ("together", "apart", "bare_base"):
        assert result[run]["tokens"] == STREAMS * 4 and result[run]["aggregate_tps"] > 0, run
    # llama_classic: hidden 64, MLP 128, 4 query and 2 KV heads of 16; rank 4 in float32, a slot per adapter and
    # the base's zero slot: (in + out) x rank per projection and layer
    features = (64 + 64) + 2 * (64 + 32) + (64 + 64) + 3 * (64 + 128)
    assert result["held_bytes"] - result["base_bytes"] == 2 * features * 4 * 4 * (ADAPTERS + 1)
