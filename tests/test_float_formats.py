"""`convert --mode mxfp4 | nvfp4 | mxfp8`: MLX's float formats beside affine, each layer rounded by MLX's own
quantizer (the reference: `mx.quantize` of the source's weight), loaded by mlxinfer and by mlx-lm."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from mlxinfer.convert import convert

import mlxinfer
from mlxinfer.cli import main
from tests.conftest import TINY

SOURCE = TINY / "llama_classic"
# MLX's formats (mlx.core.quantize): bits and group size each one fixes.
FORMATS = {"mxfp4": (4, 32), "nvfp4": (4, 16), "mxfp8": (8, 32)}


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, object]:
    made = {}
    for mode in FORMATS:
        out = tmp_path_factory.mktemp(mode) / "out"
        made[mode] = (out, convert(SOURCE, out, mode=mode, dtype="float32", eval_tokens=40, progress=False))
    return made


@pytest.mark.parametrize("mode", list(FORMATS))
def test_each_layer_is_what_mlx_quantizes_the_source_weight_to(converted, mode):
    out, _ = converted[mode]
    bits, group = FORMATS[mode]
    quantization = json.loads((out / "config.json").read_text())["quantization"]
    assert (quantization["mode"], quantization["bits"], quantization["group_size"]) == (mode, bits, group)
    written = {k: v for f in out.glob("*.safetensors") for k, v in mx.load(str(f)).items()}
    source = mx.load(str(SOURCE / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj"
    assert f"{name}.biases" not in written and written[f"{name}.scales"].dtype == mx.uint8
    expected = mx.quantize(source[f"{name}.weight"].astype(mx.float32), group_size=group, bits=bits, mode=mode)
    assert mx.array_equal(written[f"{name}.weight"], expected[0]) and mx.array_equal(
        written[f"{name}.scales"], expected[1]
    )


@pytest.mark.parametrize("mode", list(FORMATS))
def test_the_output_loads_runs_and_reports_its_quality(converted, mode):
    out, result = converted[mode]
    model = mlxinfer.load(out, cpu_weights="quantized")
    layer = model._loaded.model.model.layers[0].self_attn.q_proj
    assert (layer.mode, layer.bits, layer.group_size) == (mode, *FORMATS[mode])
    assert model.generate([1, 2, 3], max_tokens=4).stats.generated_tokens == 4
    bits, group = FORMATS[mode]
    assert result.quality is not None and result.quality.tokens == 40
    assert result.bits_per_weight == pytest.approx(bits + 8 / group, abs=0.6)  # codes, an 8-bit scale per group


def test_mlx_lm_loads_a_float_format_output(converted):
    from mlx_lm import load

    out, _ = converted["nvfp4"]
    model, _ = load(str(out))
    ids = mx.array([[1, 2, 3, 4]])
    ours = mlxinfer.load(out, cpu_weights="quantized").logits([1, 2, 3, 4])
    assert np.allclose(np.array(model(ids)[0], dtype=np.float32), ours, atol=1e-4)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--mode", "mxfp8", "--bits", "4"], "--mode mxfp8 is 8-bit in groups of 32; drop --bits and --group-size"),
        (["--mode", "nvfp4", "--group-size", "32"], "--mode nvfp4 is 4-bit in groups of 16"),
        (["--mode", "mxfp4", "--recipe", "mixed-4-8"], "--mode mxfp4 rounds every layer to nearest alike"),
        (["--mode", "mxfp4", "--method", "gptq"], "drop --recipe, --bpw and --method"),
    ],
)
def test_what_a_float_format_cannot_do_is_refused_in_one_line(tmp_path, flags, message):
    result = CliRunner().invoke(main, ["convert", str(SOURCE), "-o", str(tmp_path / "o"), *flags])
    assert result.exit_code == 1 and message in result.output and len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_a_mixture_of_experts_model_is_refused_a_float_format(tmp_path):
    result = CliRunner().invoke(
        main, ["convert", str(TINY / "qwen3_moe"), "-o", str(tmp_path / "o"), "--mode", "mxfp4"]
    )
    assert result.exit_code == 1 and "not supported for mixture-of-experts models yet" in result.output
