"""The CPU fast path: MLX's GEMMs reach OpenBLAS on Linux, and small quantized models run from float32 weights."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlxinfer.convert import convert

import mlxinfer
from mlxinfer import blas
from mlxinfer.models import load_model
from mlxinfer.models.cpu_weights import choose_cpu_weights, cpu_weights_mode

from .conftest import TINY

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OpenBLAS is routed in on Linux only")


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
        env={**os.environ, **env},
    )  # fmt: skip


@linux
def test_activating_points_mlx_gemms_at_openblas():
    report = blas.activate()  # what the first CPU model load does (tests/test_blas.py)
    assert report.name.startswith("OpenBLAS") and report.note is None, report
    assert blas.routed()  # read back from libmlx's GOT, not from the report


@pytest.fixture
def activated():
    """Routed as the first CPU model load routes it: importing mlxinfer no longer does."""
    blas.activate()


@linux
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex64])
@pytest.mark.parametrize("shape", [(1, 7, 5), (33, 64, 17), (128, 96, 200)])
def test_routed_gemms_match_numpy(dtype, shape, activated):
    assert blas.routed()
    m, k, n = shape
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal(s).astype(dtype) for s in ((m, k), (k, n)))
    if dtype == np.complex64:
        a, b = a + 1j * rng.standard_normal(a.shape).astype(np.float32), b * (1 - 0.5j)
    want = a @ b
    for x, y, expect in ((a, b, want), (b.T, a.T, want.T)):  # transposed operands take the other BLAS flags
        got = np.array(mx.matmul(mx.array(x), mx.array(y), stream=mx.cpu))
        np.testing.assert_allclose(got, expect, rtol=1e-4, atol=1e-4 * np.abs(expect).max())


@linux
def test_reference_blas_on_request_leaves_mlx_alone():
    done = _python(
        "import json, mlxinfer; from mlxinfer import blas; print(json.dumps([blas.activate().name, blas.routed()]))",
        MLXINFER_BLAS="reference",
    )
    assert done.returncode == 0, done.stderr
    name, routed = json.loads(done.stdout.splitlines()[-1])
    assert name.startswith("reference BLAS") and routed is False


@linux
def test_a_wrong_probe_result_puts_the_reference_back_with_one_line():
    done = _python(
        """
        import json, mlx.core as mx
        from mlxinfer import blas
        assert not blas.routed()  # MLXINFER_BLAS=reference: importing mlxinfer left the reference slots
        real = blas.probe_gflops
        calls = []
        def probe(n=blas.PROBE_N):  # the second probe (through OpenBLAS) finds a wrong product
            calls.append(n)
            if len(calls) == 2:
                raise ValueError("the probe matmul is wrong (relative error 1.0e+00)")
            return real(n)
        blas.probe_gflops = probe
        report = blas._route_to_openblas()
        print(json.dumps([report.name, report.note, blas.routed()]))
        """,
        MLXINFER_BLAS="reference",
    )
    assert done.returncode == 0, done.stderr
    name, note, routed = json.loads(done.stdout.splitlines()[-1])
    assert name.startswith("reference BLAS") and routed is False
    assert "OpenBLAS was not used: the probe matmul is wrong" in note and "\n" not in note


def _four_bit(tmp_path_factory, family: str) -> Path:
    out = tmp_path_factory.mktemp("q") / f"{family}-4bit"
    convert(TINY / family, out, bits=4, method="rtn", evaluate=False, progress=False)
    return out


@pytest.fixture(autouse=True)
def on_the_cpu():
    """The CPU fast path is for the CPU: on a Mac or an NVIDIA machine these tests still run it there."""
    previous = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(previous)


FALLBACK = """
import json
from mlxinfer import blas
assert not blas.routed()  # MLXINFER_BLAS=reference: importing mlxinfer left the reference slots
{setup}
report = blas._route_to_openblas()
print(json.dumps([report.name, report.note, any(blas.routed_slots().values())]))
"""
FALLBACKS = {
    "no faster": (
        "blas.probe_gflops = iter([5.0, 4.0]).__next__",  # the reference probe, then OpenBLAS's: slower
        "it ran at 4.0 GFLOP/s, no faster than 5.0",
    ),
    "fails halfway through the swaps": (
        "real, n = blas._swap, []\n"
        "def swap(address, value):\n"
        "    n.append(1)\n"
        "    if len(n) == 3: raise OSError('mprotect refused')\n"
        "    return real(address, value)\n"
        "blas._swap = swap",
        "mprotect refused",
    ),
}


@pytest.mark.slow
@linux
@pytest.mark.parametrize("case", FALLBACKS)
def test_every_fallback_puts_every_slot_back_and_says_why(case):
    setup, why = FALLBACKS[case]
    done = _python(FALLBACK.format(setup=setup), MLXINFER_BLAS="reference")
    assert done.returncode == 0, done.stderr
    name, note, routed = json.loads(done.stdout.splitlines()[-1])
    assert name.startswith("reference BLAS") and routed is False
    assert f"OpenBLAS was not used: {why}" in note and "\n" not in note


@linux
def test_a_blas_that_is_already_fast_is_left_alone():
    done = _python(FALLBACK.format(setup="blas.probe_gflops = lambda n=0: 120.0"), MLXINFER_BLAS="reference")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == ["the BLAS MLX was built with", None, False]


@pytest.fixture(scope="module")
def tiny_4bit(tmp_path_factory):
    return _four_bit(tmp_path_factory, "llama_classic")


# Dense, sliding-window, mixture of experts (experts stay quantized), hybrid recurrent, per-layer inputs.
FAMILIES = ["llama_classic", "gemma3", "qwen3_moe", "lfm2", "qwen3_next", "gemma4", "granitemoehybrid"]


@pytest.mark.parametrize("family", FAMILIES)
def test_dense_weights_compute_what_the_quantized_ones_do(tmp_path_factory, family):
    path = _four_bit(tmp_path_factory, family)
    quantized = load_model(path, cpu_weights="quantized")
    dense = load_model(path, cpu_weights="dense")
    assert (quantized.weights.kept, dense.weights.kept) == ("quantized", "dense")
    assert quantized.quantized_layers > 0
    tokens = mx.array([[1, 5, 9, 2, 7, 3, 11, 4]])
    want, got = quantized.model(tokens), dense.model(tokens)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)
    # What the planner counts is what is held: float32 weights, more than the packed ones.
    assert dense.weights_bytes > 1.5 * quantized.weights_bytes


def test_auto_keeps_quantized_weights_that_would_not_fit(tiny_4bit):
    loaded = load_model(tiny_4bit, cpu_weights="quantized")
    choice = choose_cpu_weights(loaded.model, mx.float32, usable_bytes=1024, mode="auto")
    assert choice.kept == "quantized" and "usable memory" in choice.reason
    for mode in ("auto", "dense"):  # float32 weights under float16 activations would only mix dtypes
        choice = choose_cpu_weights(loaded.model, mx.float16, usable_bytes=2**40, mode=mode)
        assert choice.kept == "quantized" and "float16" in choice.reason


def test_auto_decides_by_timing_both_on_the_largest_layer(tiny_4bit, monkeypatch):
    from mlxinfer.models import cpu_weights

    for dense_s, kept in ((0.5, "dense"), (2.0, "quantized")):
        monkeypatch.setattr(cpu_weights, "_time_both", lambda layer, rows, d=dense_s: (1.0, d))
        loaded = load_model(tiny_4bit, cpu_weights="quantized")
        choice = choose_cpu_weights(loaded.model, mx.float32, usable_bytes=2**40, mode="auto")
        assert choice.kept == kept, choice


def _toy(tied: bool) -> nn.Module:
    """A quantized model as models/decoder.py names one: model.embed_tokens, a layer, and lm_head unless tied."""
    toy = nn.Module()
    toy.model = nn.Module()
    toy.model.embed_tokens, toy.model.layers = nn.Embedding(512, 64), [nn.Linear(64, 64)]
    if not tied:
        toy.lm_head = nn.Linear(64, 512)
    nn.quantize(toy, group_size=32, bits=4)
    return toy


@pytest.mark.parametrize("tied", [True, False])
def test_dense_multiplies_from_float32_and_never_copies_a_lookup(tied):
    toy = _toy(tied)
    assert choose_cpu_weights(toy, mx.float32, usable_bytes=2**40, mode="dense").kept == "dense"
    assert type(toy.model.layers[0]) is nn.Linear
    # The tied embedding is the head, so it multiplies; an untied one is only looked up and stays packed.
    assert type(toy.model.embed_tokens) is (nn.Embedding if tied else nn.QuantizedEmbedding)
    assert tied or type(toy.lm_head) is nn.Linear


@pytest.mark.parametrize("tied", [True, False])
def test_auto_times_the_head_apart_from_the_layers(tied, monkeypatch):
    from mlxinfer.models import cpu_weights

    toy = _toy(tied)
    head = toy.model.embed_tokens if tied else toy.lm_head
    timed = []

    def time_both(layer, rows):  # the layers run faster from float32, the head does not
        timed.append((layer is head, rows))
        return (1.0, 2.0) if layer is head else (1.0, 0.5)

    monkeypatch.setattr(cpu_weights, "_time_both", time_both)
    head.scales, head.biases = head.scales.astype(mx.float16), head.biases.astype(mx.float16)  # as a GGUF stores
    choice = choose_cpu_weights(toy, mx.float32, usable_bytes=2**40, mode="auto")
    assert choice.kept == "dense", choice
    assert "head: float32 measured no faster here (2000.00 ms vs 1000.00 ms, 1 row)" in choice.reason
    assert type(toy.model.layers[0]) is nn.Linear
    assert (toy.model.embed_tokens if tied else toy.lm_head) is head  # the quantized module, not a float32 twin
    assert timed == [(False, cpu_weights.PREFILL_ROWS), (False, 1), (True, 1)]  # the head only for decode's row
    # Memory traded for speed: the head kept quantized beside float32 layers need not widen its scales per call.
    assert head.scales.dtype == head.biases.dtype == mx.float32


def test_timing_a_layer_holds_a_bounded_slice_of_it(monkeypatch):
    from mlxinfer.models import cpu_weights

    monkeypatch.setattr(cpu_weights, "TIMED_BYTES", 4 << 20)
    wide = nn.QuantizedLinear(1024, 32768, bias=False, group_size=32, bits=4)  # 128 MiB as float32
    mx.eval(wide.parameters())
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    cpu_weights._time_both(wide, 1)
    assert mx.get_peak_memory() - before < 4 * (4 << 20)  # the slice and its temporaries, not the 128 MiB


def test_the_mode_comes_from_the_environment_and_is_checked(monkeypatch):
    monkeypatch.setenv("MLXINFER_CPU_WEIGHTS", "Dense")
    assert cpu_weights_mode() == "dense" and cpu_weights_mode("quantized") == "quantized"
    monkeypatch.setenv("MLXINFER_CPU_WEIGHTS", "fast")
    with pytest.raises(mlxinfer.errors.ConfigError, match="MLXINFER_CPU_WEIGHTS='fast'"):
        cpu_weights_mode()


@pytest.mark.slow
def test_the_real_model_answers_the_same_from_float32_weights(smol_path, monkeypatch):  # the default model
    question = [{"role": "user", "content": "What is the capital of France?"}]
    answers = {}
    for mode in ("quantized", "dense"):
        monkeypatch.setenv("MLXINFER_CPU_WEIGHTS", mode)
        model = mlxinfer.load()
        answers[mode] = model.chat(question, max_tokens=12).text
        assert ("run from float32" in repr(model)) == (mode == "dense")
    assert "Paris" in answers["dense"] and answers["dense"] == answers["quantized"], answers
