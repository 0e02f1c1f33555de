"""The quality report: streamed scores, progress, and the warning's thresholds."""

from __future__ import annotations

import math

import numpy as np
import pytest
from click.testing import CliRunner
from mlxinfer.convert import ConvertSettings, convert, plan_conversion
from mlxinfer.quantize import QualityReport, compare_models, perplexity

import mlxinfer
from mlxinfer.cli import main
from tests.conftest import TINY

# Reports measured on SmolLM2-135M-Instruct (bf16 source, 512 tokens of the shipped prose):
# 4-bit round-to-nearest answers the capital-of-France question in broken French.
RTN4 = dict(tokens=512, source_ppl=16.885, output_ppl=21.070, mean_kl=0.4570, bits_per_weight=4.5)
# 4-bit GPTQ answers "Paris", but its perplexity is still far from the source's.
GPTQ4 = dict(tokens=512, source_ppl=16.885, output_ppl=20.446, mean_kl=0.1867, bits_per_weight=4.5)
# 8-bit answers "The capital of France is Paris."
BITS8 = dict(tokens=512, source_ppl=16.885, output_ppl=16.794, mean_kl=0.0026, bits_per_weight=8.5)


def test_warning_names_the_cost_and_the_fix_past_either_threshold():
    report = QualityReport(**RTN4, advice="try `--bits 8`")
    assert report.warning.startswith("quality warning: perplexity +24.8% and mean KL 0.46 nats over 512 tokens")
    assert report.warning.endswith("try `--bits 8`")
    assert report.to_dict()["warning"] == report.warning and "try `--bits 8`" in report._repr_html_()
    assert QualityReport(**BITS8).warning is None and QualityReport(**BITS8).to_dict()["warning"] is None
    kl_only = QualityReport(tokens=512, source_ppl=10.0, output_ppl=10.5, mean_kl=0.25)
    assert "+5.0%" in kl_only.warning and "+21.1%" in QualityReport(**GPTQ4).warning


def full_text_scores(source: mlxinfer.Model, output: mlxinfer.Model, ids: list[int]) -> tuple[float, float, float]:
    """Perplexities and mean KL from whole-text logits, the way the report was first computed."""

    def log_softmax(x):
        x = x.astype(np.float64)
        x = x - x.max(axis=-1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))

    src, out = log_softmax(source.logits(ids)[:-1]), log_softmax(output.logits(ids)[:-1])
    rows = np.arange(len(ids) - 1), ids[1:]
    kl = (np.exp(src) * (src - out)).sum(axis=-1).mean()
    return math.exp(-src[rows].mean()), math.exp(-out[rows].mean()), kl


def test_streamed_report_matches_whole_text_scores_and_reports_progress(tiny_llama, tmp_path):
    convert(TINY / "llama_classic", tmp_path / "q4", bits=4, group_size=32, evaluate=False, progress=False)
    output = mlxinfer.load(tmp_path / "q4")
    ids = [int(i) for i in np.random.default_rng(0).integers(0, tiny_llama.config.vocab_size, 70)]
    ticks: list[int] = []
    report = compare_models(tiny_llama, output, ids, chunk_tokens=32, progress=ticks.append)
    source_ppl, output_ppl, kl = full_text_scores(tiny_llama, output, ids)
    assert report.source_ppl == pytest.approx(source_ppl, rel=1e-9)
    assert report.output_ppl == pytest.approx(output_ppl, rel=1e-9)
    assert report.mean_kl == pytest.approx(kl, rel=1e-9)
    assert ticks == [32, 32, 32, 32, 6, 6]  # each model, chunk by chunk
    ticks.clear()
    assert perplexity(output, ids, chunk_tokens=64, progress=ticks.append) == pytest.approx(output_ppl, rel=1e-9)
    assert ticks == [64, 6]


def test_eval_command_shows_progress(tmp_path):
    result = CliRunner().invoke(main, ["eval", str(TINY / "llama_classic"), "--max-tokens", "100"])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("perplexity ")
    assert "perplexity: 100%" in result.stderr and "100/100" in result.stderr


def test_convert_shows_progress_for_calibration_and_the_report(tmp_path):
    args = [str(TINY / "llama_rope_linear"), "-o", str(tmp_path / "o"), "--bpw", "6", "--eval-tokens", "40"]
    result = CliRunner().invoke(main, ["convert", *args])
    assert result.exit_code == 0, result.output
    assert "sensitivity: 100%" in result.stderr and "GPTQ: 100%" in result.stderr  # --bpw picks GPTQ
    assert "quality report: 100%" in result.stderr and "80/80" in result.stderr  # both models, 40 tokens each


def test_plan_prints_both_forecasts_when_the_report_costs_more(tmp_path):
    plan = plan_conversion(TINY / "llama_classic", tmp_path / "o", ConvertSettings(bits=4))
    plan.source.close()
    assert plan.peak_bytes > plan.no_eval_peak_bytes
    expected = f"expected peak memory {plan.peak_bytes / 2**20:.0f} MiB ({plan.no_eval_peak_bytes / 2**20:.0f} MiB"
    assert f"{expected} with --no-eval)" in plan.summary()
    no_eval = plan_conversion(TINY / "llama_classic", tmp_path / "o", ConvertSettings(bits=4, evaluate=False))
    no_eval.source.close()
    assert no_eval.summary().endswith(f"expected peak memory {plan.no_eval_peak_bytes / 2**20:.0f} MiB")
