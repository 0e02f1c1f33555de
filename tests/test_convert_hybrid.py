"""Converting the hybrid and MoE families: the runtime's layout, quantized experts, loading back.

These tiny random models amplify any change to their weights (rounding only qwen3_next's embedding
to 8 bits moves its logits by up to 2.4), so closeness to transformers is checked loosely, and
exactness where it can be: the output is the float model with its quantized weights rounded.
"""

from __future__ import annotations

import json
import shutil
from functools import partial
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from mlx.utils import tree_flatten
from mlxinfer.convert import convert

import mlxinfer
from mlxinfer.cli import main
from mlxinfer.errors import WeightMismatchError
from tests.conftest import TINY, golden

FAMILIES = ["lfm2", "qwen3_next", "qwen3_5", "gpt_oss", "granitemoehybrid"]
MOE = {"qwen3_next": "mlp.gate", "gpt_oss": "mlp.router", "granitemoehybrid": "block_sparse_moe.router.layer"}
# RMS logit error against transformers over the logits' standard deviation, 8-bit float32 output.
# Measured: lfm2 0.046, qwen3_next 0.385, qwen3_5 0.064, gpt_oss 0.147, granitemoehybrid 0.162
# (max |diff| 0.51, 6.5, 0.60, 1.6, 1.4). A layout bug (a Qwen norm without its +1, an expert's
# inputs reversed) measures 1.1 to 1.4.
RELATIVE_RMS_8BIT = 0.6


def stored(folder: Path) -> dict[str, mx.array]:
    tensors: dict[str, mx.array] = {}
    for path in sorted(folder.glob("model-*.safetensors")):
        tensors.update(mx.load(str(path)))
    return tensors


def relative_rms(logits: np.ndarray, reference: np.ndarray) -> float:
    return float(np.sqrt(((logits - reference) ** 2).mean()) / reference.std())


@pytest.mark.parametrize("family", FAMILIES)
def test_8bit_output_is_the_float_model_with_its_weights_rounded(family, tmp_path):
    out = tmp_path / family
    convert(TINY / family, out, bits=8, dtype="float32", evaluate=False, progress=False)
    files = stored(out)
    # The float model as the loader builds it from the Hugging Face checkpoint (test_parity: transformers' logits).
    reference = mlxinfer.load(TINY / family, dtype="float32")
    rounded, stacked = [], 0
    for name, value in tree_flatten(reference._loaded.model.parameters()):
        stem = name.removesuffix(".weight")
        if f"{stem}.scales" not in files:
            assert mx.array_equal(files[name], value), name  # conv kernels, norms (+1 for Qwen), biases, sinks
            continue
        packed, scales, biases = files[name], files[f"{stem}.scales"], files[f"{stem}.biases"]
        group = value.shape[-1] // scales.shape[-1]
        assert (packed.dtype, packed.shape[:-1], packed.shape[-1] * 32 // value.shape[-1]) == (
            mx.uint32,
            value.shape[:-1],
            8,
        )
        weight = mx.dequantize(packed, scales, biases, group_size=group, bits=8)
        # Rounded in the module's layout: every weight within one step of its float value (mx.quantize
        # shifts its grid so that zero is exact, which costs up to half a step more than rounding to nearest).
        error = np.abs(np.array(weight - value)).reshape(*scales.shape, group)
        assert (error <= np.abs(np.array(scales))[..., None] + 1e-6).all(), name
        rounded.append((name, weight))
        stacked += value.ndim == 3
    assert (stacked > 0) == (family in MOE)  # the experts' (experts, out, in) weights were quantized
    output = mlxinfer.load(out, dtype="float32")
    ids = golden(family)["input_ids"].tolist()
    logits = output.logits(ids)
    reference._loaded.model.load_weights(rounded, strict=False)
    assert np.abs(logits - reference.logits(ids)).max() < 1e-4  # quantized modules compute their stored weights
    assert relative_rms(logits, np.array(golden(family)["logits"])) < RELATIVE_RMS_8BIT


def modules(model: mlxinfer.Model) -> dict[str, object]:
    return dict(model._loaded.model.named_modules())


@pytest.mark.parametrize("family", FAMILIES)
def test_4bit_converts_loads_and_generates_with_routers_at_8_bits(family, tmp_path):
    out = tmp_path / family
    result = convert(TINY / family, out, bits=4, eval_tokens=32, progress=False)  # bfloat16, with the report
    assert result.quality is not None and result.quality.tokens == 32
    if family not in MOE:  # the recurrent families' advice never names the sensitivity recipe they refuse
        assert "sensitivity" not in (result.quality.advice or "")
    model = mlxinfer.load(out)
    loaded = modules(model)
    assert {m.bits for m in loaded.values() if hasattr(m, "bits") and hasattr(m, "group_size")} >= {4}
    if family in MOE:
        router = f"model.layers.0.{MOE[family]}"
        # mlx-lm's quant_predicate for the family: routers at 8 bits, group size 64.
        assert json.loads((out / "config.json").read_text())["quantization"][router] == {"group_size": 64, "bits": 8}
        assert loaded[router].bits == 8
        assert any(type(m).__name__ == "QuantizedSwitchLinear" and m.bits == 4 for m in loaded.values())
    ids = golden(family)["input_ids"].tolist()
    assert np.isfinite(model.logits(ids)).all()
    assert model.generate(ids, max_tokens=4).stats.generated_tokens >= 1


def cli_convert(*args: str):
    return CliRunner().invoke(main, ["convert", *args])


def damaged(tmp_path: Path, family: str, change) -> Path:
    folder = tmp_path / f"{family}-damaged"
    shutil.copytree(TINY / family, folder)
    tensors = mx.load(str(folder / "model.safetensors"))
    mx.save_safetensors(str(folder / "model.safetensors"), change(tensors))
    return folder


def without(name: str):
    return lambda tensors: {k: v for k, v in tensors.items() if k != name}


def transposed(name: str):
    return lambda tensors: {**tensors, name: tensors[name].swapaxes(1, 2)}


@pytest.mark.parametrize(
    ("family", "change", "words"),
    [
        ("qwen3_next", without("model.layers.1.mlp.experts.2.up_proj.weight"), "experts.*.up_proj (3 of 4)"),
        ("granitemoehybrid", without("model.layers.2.block_sparse_moe.output_linear.weight"), "output_linear"),
        ("gpt_oss", transposed("model.layers.0.mlp.experts.gate_up_proj"), "gate_up_proj: shape (4, 48, 64)"),
        ("lfm2", without("model.layers.0.conv.conv.weight"), "missing: model.layers.0.conv.conv.weight"),
    ],
)
def test_a_bad_checkpoint_is_one_line_and_writes_nothing(family, change, words, tmp_path):
    out = tmp_path / "out"
    result = cli_convert(str(damaged(tmp_path, family, change)), "-o", str(out), "--bits", "8", "--no-eval")
    assert result.exit_code == 1, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and words in errors[0], result.stderr
    assert not out.exists() and not list(tmp_path.glob(".*out*"))


@pytest.mark.slow
def test_the_stream_holds_one_layer_of_experts_at_a_time(tmp_path):
    from mlxinfer.convert.layout import converted_tensors
    from mlxinfer.convert.sources import FolderSource

    from mlxinfer.families.qwen3_next import to_mlx_layout

    layers, experts, shape = 8, 4, (256, 1024)  # one projection's experts: 4 MiB in float32, the model 96 MiB
    tensors = {
        f"model.layers.{i}.mlp.experts.{e}.{p}.weight": mx.random.normal(shape)
        for i in range(layers)
        for e in range(experts)
        for p in ("gate_proj", "up_proj", "down_proj")
    }
    mx.save_safetensors(str(tmp_path / "model.safetensors"), tensors)
    (tmp_path / "config.json").write_text("{}")
    group = experts * np.prod(shape) * 4
    del tensors
    mx.clear_cache()
    source = FolderSource(tmp_path)
    mx.reset_peak_memory()
    held = mx.get_active_memory()  # what the rest of this process holds (other tests' models) is not the stream's
    written = []
    for name, value in converted_tensors(source, sorted(source.tensors), partial(to_mlx_layout, num_experts=experts)):
        mx.eval(value)
        assert value.shape == (experts, *shape)
        written.append(name)
        del value
    assert len(written) == 3 * layers
    assert mx.get_peak_memory() - held <= 2.5 * group  # the group read and its stacked output, not the model


def quantized_qwen3_next(tmp_path: Path) -> Path:
    out = tmp_path / "q8"
    convert(TINY / "qwen3_next", out, bits=8, evaluate=False, progress=False)
    return out


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (
            lambda w, k: {**w, f"{k}.weight": w[f"{k}.weight"].reshape(-1, w[f"{k}.weight"].shape[-1])},
            "packed uint32 3-D",
        ),
        (lambda w, k: {**w, f"{k}.scales": mx.repeat(w[f"{k}.scales"], 3, -1)}, "3 groups do not divide 64 inputs"),
        (lambda w, k: {**w, f"{k}.weight": w[f"{k}.weight"][..., :3]}, "packed width 3 does not fit 64 inputs"),
        (lambda w, k: {**w, f"{k}.scales": w[f"{k}.scales"][0]}, "is not one scale per group"),
    ],
)
def test_hostile_quantized_expert_shapes_are_refused(tmp_path, change, words):
    out = quantized_qwen3_next(tmp_path)
    (shard,) = out.glob("model-*.safetensors")
    key = "model.layers.0.mlp.switch_mlp.gate_proj"
    mx.save_safetensors(str(shard), change(mx.load(str(shard)), key))
    with pytest.raises(WeightMismatchError, match=words):
        mlxinfer.load(out)


@pytest.mark.parametrize("name", ["qwen3_5_vl", "gemma3_vl"])
def test_a_vision_language_checkpoint_converts_to_its_text_model(name, tmp_path, caplog):
    out = tmp_path / name
    convert(TINY / name, out, bits=16, dtype="float32", evaluate=False, progress=False)
    assert "skipped the vision tower" in caplog.text
    config = json.loads((out / "config.json").read_text())
    # A flat "qwen3_5" config is mlx-lm's form of the Qwen3.5 text model (it has no qwen3_5_text module).
    assert config["model_type"] in ("qwen3_5", "gemma3_text") and "vision_config" not in config
    assert "text_config" not in config
    assert not any("vision" in n or "visual" in n for n in stored(out))
    ref = golden(name)  # transformers' full model on text alone
    logits = mlxinfer.load(out).logits(ref["input_ids"].tolist())
    assert np.abs(logits - np.array(ref["logits"])).max() < 1e-3
