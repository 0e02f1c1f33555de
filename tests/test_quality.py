"""The quality report: streamed scores, progress, and the warning's thresholds."""

from __future__ import annotations

import math
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from mlxinfer.convert import ConvertSettings, convert, plan_conversion
from mlxinfer.quantize import QualityReport, compare_models, perplexity

import mlxinfer
from mlxinfer.cli import main
from mlxinfer.errors import SamplingError
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


def whole_text_scores(src_logits: np.ndarray, out_logits: np.ndarray, ids: list[int]) -> tuple[float, float, float]:
    """Perplexities and mean KL from all of a text's logits at once, the way the report was first computed."""

    def log_softmax(x):
        x = x.astype(np.float64)
        x = x - x.max(axis=-1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))

    src, out = log_softmax(src_logits[:-1]), log_softmax(out_logits[:-1])
    rows = np.arange(len(ids) - 1), ids[1:]
    kl = (np.exp(src) * (src - out)).sum(axis=-1).mean()
    return math.exp(-src[rows].mean()), math.exp(-out[rows].mean()), kl


def chunked_logits(model: mlxinfer.Model, ids: list[int], chunk_tokens: int) -> np.ndarray:
    return np.concatenate(list(model.logit_chunks(ids, chunk_tokens)))


def test_streamed_report_matches_whole_text_scores_and_reports_progress(tiny_llama, tmp_path):
    convert(TINY / "llama_classic", tmp_path / "q4", bits=4, group_size=32, evaluate=False, progress=False)
    output = mlxinfer.load(tmp_path / "q4")
    ids = [int(i) for i in np.random.default_rng(0).integers(0, tiny_llama.config.vocab_size, 70)]
    ticks: list[int] = []
    report = compare_models(tiny_llama, output, ids, chunk_tokens=32, progress=ticks.append)
    # The running sums against the same chunks' logits scored at once: only the summing differs.
    same = whole_text_scores(chunked_logits(tiny_llama, ids, 32), chunked_logits(output, ids, 32), ids)
    assert (report.source_ppl, report.output_ppl, report.mean_kl) == pytest.approx(same, rel=1e-9)
    # Against one pass over the whole text: chunking changes the arithmetic order (and, in a 16-bit
    # compute dtype, the rounding), within the 1e-4 that tests/test_parity.py allows between chunkings.
    whole = whole_text_scores(tiny_llama.logits(ids, chunk_tokens=512), output.logits(ids, chunk_tokens=512), ids)
    assert (report.source_ppl, report.output_ppl) == pytest.approx(whole[:2], rel=1e-4)
    assert report.mean_kl == pytest.approx(whole[2], rel=1e-3, abs=1e-4)
    assert ticks == [32, 32, 32, 32, 6, 6]  # each model, chunk by chunk
    ticks.clear()
    # Against the same 64-token chunks scored at once (a BLAS may round a 64-row product unlike a 32-row one).
    same_64 = whole_text_scores(chunked_logits(tiny_llama, ids, 64), chunked_logits(output, ids, 64), ids)
    assert perplexity(output, ids, chunk_tokens=64, progress=ticks.append) == pytest.approx(same_64[1], rel=1e-9)
    assert ticks == [64, 6]


def test_scoring_fewer_than_two_tokens_is_a_clear_error(tiny_llama):
    for score in (lambda ids: perplexity(tiny_llama, ids), lambda ids: compare_models(tiny_llama, tiny_llama, ids)):
        for ids in ([], [5]):
            with pytest.raises(SamplingError, match=f"at least 2 tokens .*got {len(ids)}"):
                score(ids)


def test_logit_chunks_refuses_bad_arguments_before_the_first_chunk(tiny_llama):
    with pytest.raises(SamplingError, match="chunk_tokens must be a positive integer, got 0"):
        tiny_llama.logit_chunks([1, 2, 3], 0)  # not iterated: the call itself refuses
    with pytest.raises(SamplingError):
        tiny_llama.logit_chunks([1, tiny_llama.config.vocab_size], 8)


def test_eval_command_shows_progress(tmp_path):
    result = CliRunner().invoke(main, ["eval", str(TINY / "llama_classic"), "--max-tokens", "100"])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("perplexity ")
    assert "perplexity: 100%" in result.stderr and "100/100" in result.stderr


@pytest.mark.slow
def test_convert_shows_progress_for_calibration_and_the_report(tmp_path):
    args = [str(TINY / "llama_rope_linear"), "-o", str(tmp_path / "o"), "--bpw", "6", "--eval-tokens", "40"]
    result = CliRunner().invoke(main, ["convert", *args])
    assert result.exit_code == 0, result.output
    assert "sensitivity: 100%" in result.stderr and "GPTQ: 100%" in result.stderr  # --bpw picks GPTQ
    assert "quality report: 100%" in result.stderr and "80/80" in result.stderr  # both models, 40 tokens each


def test_plan_prints_both_forecasts_when_the_report_costs_more(tmp_path):
    plan = plan_conversion(TINY / "llama_classic", tmp_path / "o", ConvertSettings(bits=4, method="rtn"))
    plan.source.close()
    assert plan.peak_bytes > plan.no_eval_peak_bytes
    expected = f"expected peak memory {plan.peak_bytes / 2**20:.0f} MiB ({plan.no_eval_peak_bytes / 2**20:.0f} MiB"
    assert f"{expected} with --no-eval)" in plan.summary()
    settings = ConvertSettings(bits=4, method="rtn", evaluate=False)
    no_eval = plan_conversion(TINY / "llama_classic", tmp_path / "o", settings)
    no_eval.source.close()
    assert no_eval.summary().endswith(f"expected peak memory {plan.no_eval_peak_bytes / 2**20:.0f} MiB")


@pytest.mark.parametrize(
    "settings, expected",
    [
        (dict(bits=16), None),
        (dict(bits=8), "try `--bits 16` (unquantized): every layer already has 8 bits"),
        # 4-bit at group size 64 stores 4.5 bits/weight; a quarter bit over it measured within the limits.
        (
            dict(bits=4),
            "try `--recipe sensitivity --group-size 64 --bpw 4.75` (more bits where they matter) or, "
            "safest, `--bits 8`",
        ),
        # At 128 a quarter bit over 4-bit is 4.5: the group size must be named, or a rerun at 64 gets plain 4-bit.
        (
            dict(bits=4, group_size=128),
            "try `--recipe sensitivity --group-size 128 --bpw 4.5` (more bits where "
            "they matter) or, safest, `--bits 8`",
        ),
        (
            dict(bits=4, recipe="mixed-4-8"),
            "try `--recipe sensitivity --group-size 64 --bpw 4.75` (more bits "
            "where they matter) or, safest, `--bits 8` with no --recipe or --bpw",
        ),
        (
            dict(bits=4, recipe="sensitivity", bpw=5.0),
            "try a larger `--bpw` than 5 (at most 8.5), or, safest, `--bits 8` with no --recipe or --bpw",
        ),
        # 8.5 bits/weight at group size 64 is 8 bits everywhere: no larger budget exists.
        (
            dict(bits=4, bpw=8.5),
            "try `--bits 16` with no --recipe or --bpw (unquantized): every layer already has 8 bits",
        ),
        (
            dict(bits=4, bpw=9.0, group_size=32),
            "try `--bits 16` with no --recipe or --bpw (unquantized): every layer already has 8 bits",
        ),
    ],
)
def test_advice_names_a_rerun_that_changes_something(settings, expected):
    from mlxinfer.convert.pipeline import _advice

    assert _advice(ConvertSettings(**{"group_size": 64, **settings})) == expected


def test_advice_after_round_to_nearest_names_the_learned_default_where_it_can_run():
    from mlxinfer.convert.pipeline import _advice

    rtn = ConvertSettings(bits=4, group_size=64, method="rtn")
    assert _advice(rtn, learned=True) == (
        "try plain `--bits 4` without --method rtn (the learned default) or, safest, `--bits 8`"
    )
    assert _advice(rtn, learned=False).startswith("try `--recipe sensitivity --group-size 64 --bpw 4.75`")


def test_a_plan_without_a_separate_no_eval_forecast_prints_one_peak(tmp_path):
    plan = plan_conversion(TINY / "llama_classic", tmp_path / "o", ConvertSettings(bits=4, method="rtn"))
    plan.source.close()
    plan.no_eval_peak_bytes = None  # as a plan built by hand, without the field, has it
    assert plan.summary().endswith(f"expected peak memory {plan.peak_bytes / 2**20:.0f} MiB")


# SmolLM2-135M's shapes, from its config.json: hidden, vocab, layers, KV heads, head_dim, MLP width.
H, V, L, KV, D, MLP = 576, 49152, 30, 3, 64, 1536
LINEAR = L * (2 * H * H + 2 * KV * D * H + 3 * MLP * H)  # q, o; k, v; gate, up, down
EMBED, NORMS = V * H, (2 * L + 1) * H  # tied head; two norms a layer and the final one


def kv_bytes(positions: int, size: int) -> int:
    return 2 * 2 * L * KV * D * positions * size  # two models, keys and values


def evaluation_bytes(plan, compute, monkeypatch) -> int:
    from mlxinfer.convert import evaluation

    monkeypatch.setattr(evaluation, "choose_compute_dtype", lambda requested=None: compute)
    args = (plan.source, plan.config, plan.layers, plan.names, plan.settings.eval_tokens, plan.shapes, plan.dtype)
    return evaluation.evaluation_bytes(*args)


def test_report_forecast_counts_a_bf16_source_once_when_it_computes_in_bf16(smol_hf, tmp_path, monkeypatch):
    monkeypatch.setenv("MLXINFER_CPU_WEIGHTS", "quantized")  # the weights as stored (dense: the test below)
    plan = plan_conversion(smol_hf, tmp_path / "o", ConvertSettings(bits=4, group_size=64))
    plan.source.close()
    source = (LINEAR + EMBED + NORMS) * 2  # loaded as stored: nothing to cast
    output = (LINEAR + EMBED) * (4 / 8 + 2 * 2 / 64) + NORMS * 2  # 4-bit weights, bf16 scales and biases
    scores = 32 * V * (2 * (2 + 4 + 4) + 6 * 8)  # bf16 and float32 logits in MLX, numpy's float32 and float64 ones
    expected = source + output + kv_bytes(512, 2) + scores
    assert evaluation_bytes(plan, mx.bfloat16, monkeypatch) == expected
    # In float32 the two largest bf16 tensors are held while they are cast (each is freed once cast), and the
    # output loads into that memory; its bf16 scales and biases stay bf16, its norms are float32.
    cast = (EMBED + MLP * H) * 2
    output = (LINEAR + EMBED) * (4 / 8 + 2 * 2 / 64) + NORMS * 4
    scores = 32 * V * (2 * (4 + 4 + 4) + 6 * 8)
    assert output > cast  # so the output is what counts
    assert evaluation_bytes(plan, mx.float32, monkeypatch) == 2 * source + output + kv_bytes(512, 4) + scores


def test_report_forecast_keeps_a_gguf_source_packed(smol_path, tmp_path, monkeypatch):
    monkeypatch.setenv("MLXINFER_CPU_WEIGHTS", "quantized")
    plan = plan_conversion(smol_path, tmp_path / "o", ConvertSettings(bits=4, eval_tokens=300))
    plan.source.close()
    # The source holds what it loads, not its file's bytes: the Q4_1 codes (16 bytes per 32 weights) and Q8_0's
    # (32), each group with a scale and a bias in float16 as the file stores them (narrower than the CPU's
    # float32); norms float32. The output keeps the same grid and 16-bit scales, so both weigh the same.
    source = output = LINEAR * (4 / 8 + 2 * 2 / 32) + EMBED * (1 + 2 * 2 / 32) + NORMS * 4
    scores = 32 * V * (2 * (4 + 4 + 4) + 6 * 8)
    # 300 tokens: the KV cache grows 256 positions at a time, to 512.
    assert evaluation_bytes(plan, mx.float32, monkeypatch) == source + output + kv_bytes(512, 4) + scores


def test_report_forecast_on_a_cpu_counts_both_models_as_the_float32_they_load_as(smol_path, tmp_path, monkeypatch):
    """On a CPU the report loads both models with float32 copies of their quantized layers where those fit
    (faster there); the forecast counts them so, whatever the file holds."""
    monkeypatch.delenv("MLXINFER_CPU_WEIGHTS", raising=False)
    plan = plan_conversion(smol_path, tmp_path / "o", ConvertSettings(bits=8, eval_tokens=300))
    plan.source.close()
    dense = (LINEAR + EMBED + NORMS) * 4
    # Loading the output holds its 8-bit layers (a 16-bit scale and bias per 32, as written) beside float32
    # copies of its quantized matrices (the tied embedding among them: it is the head).
    stored = (LINEAR + EMBED) * (1 + 2 * 2 / 32) + NORMS * 4
    scores = 32 * V * (2 * (4 + 4 + 4) + 6 * 8)
    dequantizing = EMBED * 4  # MLX's dequantize of the largest tensor holds a float32 temporary as large
    expected = dense + stored + (LINEAR + EMBED) * 4 + dequantizing + kv_bytes(512, 4) + scores
    assert evaluation_bytes(plan, mx.float32, monkeypatch) == expected


def test_the_quality_warning_is_logged_once_for_scripts(tmp_path, caplog):
    # The tiny random model's 4-bit copy is far from it (KL about 0.4 nats): the report warns.
    result = convert(TINY / "llama_classic", tmp_path / "o", bits=4, method="rtn", eval_tokens=40, progress=False)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert result.warning and warnings == [result.warning]


def test_the_cli_shows_the_quality_warning_once(tmp_path):
    command = [sys.executable, "-m", "mlxinfer.cli", "convert", str(TINY / "llama_classic"), "-o", str(tmp_path / "o")]
    done = subprocess.run(
        [*command, "--method", "rtn", "--eval-tokens", "40"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-1500:]
    assert (done.stdout + done.stderr).count("quality warning:") == 1, done.stderr


def test_a_conversion_without_progress_writes_nothing_to_stderr(tmp_path, capfd):
    convert(TINY / "llama_classic", tmp_path / "o", bits=4, method="rtn", eval_tokens=40, progress=False)
    assert capfd.readouterr().err == ""


def test_eval_reads_and_tokenizes_only_a_bounded_prefix(tmp_path, monkeypatch):
    from mlxinfer.tokenizer import Tokenizer

    # Ample text for 4 tokens, then a byte that is not UTF-8 far past what 4 tokens could need.
    text = tmp_path / "t.txt"
    text.write_bytes(b"The quick brown fox jumps over the lazy dog. " * 200 + b"\xff")
    seen: list[int] = []
    encode = Tokenizer.encode
    monkeypatch.setattr(Tokenizer, "encode", lambda self, s, *a, **k: seen.append(len(s)) or encode(self, s, *a, **k))
    result = CliRunner().invoke(main, ["eval", str(TINY / "llama_classic"), "--text", str(text), "--max-tokens", "4"])
    assert result.exit_code == 0, result.output
    assert result.stderr.startswith(f"Loading {TINY / 'llama_classic'}...")
    assert seen and max(seen) <= 4 * mlxinfer.api.MAX_CHARS_PER_TOKEN
    assert "over 4 tokens" in result.stdout


def test_eval_of_a_text_that_is_not_utf8_is_one_line(tmp_path):
    text = tmp_path / "t.txt"
    text.write_bytes(b"ok \xff\xfe")
    result = CliRunner().invoke(main, ["eval", str(TINY / "llama_classic"), "--text", str(text)])
    assert result.exit_code == 1 and result.exception.__class__ is SystemExit
    assert result.output.strip().endswith(f"{text}: not UTF-8 text (byte 3); save it as UTF-8")
