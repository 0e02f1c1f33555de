"""MoE families (Qwen3-MoE, Qwen3.5-MoE, Mixtral, OLMoE, Granite 3 MoE): converting, malformed input, config quirks.

Parity with transformers is tests/test_parity.py's (every fixture here is in conftest's ARCHITECTURES); here the
converter's output is checked against the float model, broken checkpoints against their one-line errors, and the
config forms real checkpoints use against transformers' logits (golden.safetensors).
"""

from __future__ import annotations

import json
import re
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
from mlxinfer.errors import ConfigError, UnsupportedModelError, WeightMismatchError
from mlxinfer.families.mixtral import MIXTRAL
from mlxinfer.models.config import SLIDING, normalize_config
from mlxinfer.models.moe_weights import QWEN, to_switch_layout
from tests.conftest import TINY, golden

# One fixture per family -> (a MoE layer's router path, the bits mlx-lm's quant_predicate gives it at --bits 4).
# mlx-lm 0.32's mixtral and olmoe define no quant_predicate: their routers get the run's bits, as in mlx-lm.
# Every router at 8 bits: mlx-lm's rule where its module has one, convert/mlx_lm_rules.routers_at_8_bits for
# mixtral and olmoe, whose modules have none.
ROUTERS = {
    "qwen3_moe": "model.layers.0.mlp.gate",
    "qwen3_5_moe": "model.layers.0.mlp.gate",
    "mixtral": "model.layers.0.block_sparse_moe.gate",
    "olmoe": "model.layers.0.mlp.gate",
    "granitemoe": "model.layers.0.block_sparse_moe.router.layer",
}
FAMILIES = list(ROUTERS)
# RMS logit error against transformers over the logits' standard deviation, 8-bit float32 output. Measured:
# qwen3_moe 0.052, qwen3_5_moe 0.144, mixtral 0.085, olmoe 0.030, granitemoe 0.066 (max |diff| 0.98, 1.67, 1.36,
# 0.28, 0.74: rounding flips a few near-tied expert choices); granitemoe with gate and up swapped measures 0.82.
RELATIVE_RMS_8BIT = 0.3


def stored(folder: Path) -> dict[str, mx.array]:
    tensors: dict[str, mx.array] = {}
    for path in sorted(folder.glob("model*.safetensors")):
        tensors.update(mx.load(str(path)))
    return tensors


def max_diff(model: mlxinfer.Model, name: str) -> float:
    ref = golden(name)
    return float(np.abs(model.logits(ref["input_ids"].tolist()) - np.array(ref["logits"])).max())


@pytest.mark.parametrize("family", FAMILIES)
def test_8bit_output_is_the_float_model_with_its_weights_rounded(family, tmp_path):
    out = tmp_path / family
    convert(TINY / family, out, bits=8, dtype="float32", evaluate=False, progress=False)
    files = stored(out)
    reference = mlxinfer.load(TINY / family, dtype="float32")  # test_parity: transformers' logits
    rounded, experts = [], 0
    for name, value in tree_flatten(reference._loaded.model.parameters()):
        stem = name.removesuffix(".weight")
        if f"{stem}.scales" not in files:
            assert mx.array_equal(files[name], value), name  # norms (+1 for Qwen3.5), conv kernels, A_log
            continue
        scales, biases = files[f"{stem}.scales"], files[f"{stem}.biases"]
        group = value.shape[-1] // scales.shape[-1]
        weight = mx.dequantize(files[name], scales, biases, group_size=group, bits=8)
        error = np.abs(np.array(weight - value)).reshape(*scales.shape, group)
        assert (error <= np.abs(np.array(scales))[..., None] + 1e-6).all(), name  # within one step
        rounded.append((name, weight))
        experts += value.ndim == 3 and ".switch_mlp." in name
    assert experts >= 3  # each MoE layer's stacked (experts, out, in) gate, up and down were quantized
    output = mlxinfer.load(out, dtype="float32")
    ids = golden(family)["input_ids"].tolist()
    logits = output.logits(ids)
    reference._loaded.model.load_weights(rounded, strict=False)
    assert np.abs(logits - reference.logits(ids)).max() < 1e-4
    reference_logits = np.array(golden(family)["logits"])
    relative = np.sqrt(((logits - reference_logits) ** 2).mean()) / reference_logits.std()
    assert relative < RELATIVE_RMS_8BIT


@pytest.mark.parametrize("family", FAMILIES)
def test_4bit_converts_loads_and_generates_with_routers_at_8_bits(family, tmp_path):
    out = tmp_path / family
    convert(TINY / family, out, bits=4, evaluate=False, progress=False)
    model = mlxinfer.load(out)
    loaded = dict(model._loaded.model.named_modules())
    router = ROUTERS[family]
    assert loaded[router].bits == 8
    written = json.loads((out / "config.json").read_text())["quantization"]
    assert written[router] == {"group_size": 64, "bits": 8}
    if family == "qwen3_5_moe":  # its shared expert's sigmoid gate too
        assert loaded["model.layers.0.mlp.shared_expert_gate"].bits == 8
    assert any(type(m).__name__ == "QuantizedSwitchLinear" and m.bits == 4 for m in loaded.values())
    ids = golden(family)["input_ids"].tolist()
    assert np.isfinite(model.logits(ids)).all()
    assert model.generate(ids, max_tokens=4).stats.generated_tokens >= 1


def write_experts(folder: Path, layout: str, layers: int, experts: int, shape: tuple[int, int]) -> None:
    tensors = {}
    for i in range(layers):
        if layout == "per-expert":  # Mixtral's names
            for e in range(experts):
                for w in ("w1", "w2", "w3"):
                    tensors[f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}.weight"] = mx.random.normal(shape)
        else:  # Qwen3.5-MoE's fused tensors: gate and up on axis 1
            mlp = f"model.layers.{i}.mlp.experts"
            tensors[f"{mlp}.gate_up_proj"] = mx.random.normal((experts, 2 * shape[0], shape[1]))
            tensors[f"{mlp}.down_proj"] = mx.random.normal((experts, *shape))
        mx.eval(tensors)
    mx.save_safetensors(str(folder / "model.safetensors"), tensors)
    (folder / "config.json").write_text("{}")


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "kind"), [("per-expert", MIXTRAL), ("fused", QWEN)])
def test_the_stream_holds_one_layer_of_experts_at_a_time(layout, kind, tmp_path):
    from mlxinfer.convert.layout import converted_tensors
    from mlxinfer.convert.sources import FolderSource

    layers, experts, shape = 8, 4, (256, 1024)  # one projection's experts: 4 MiB in float32, the model 96 MiB
    write_experts(tmp_path, layout, layers, experts, shape)
    group = experts * np.prod(shape) * 4
    mx.clear_cache()
    source = FolderSource(tmp_path)
    mx.reset_peak_memory()
    held = mx.get_active_memory()  # what the rest of this process holds is not the stream's
    sanitize = partial(to_switch_layout, layout=kind, num_experts=experts, source="test")
    written = []
    for name, value in converted_tensors(source, sorted(source.tensors), sanitize):
        mx.eval(value)
        assert value.shape[0] == experts and ".switch_mlp." in name
        written.append(name)
        del value
    assert len(written) == 3 * layers
    # The group read and its stacked output (per expert), or one fused gate_up tensor and its halves.
    assert mx.get_peak_memory() - held <= 2.5 * group


def copy_of(tmp_path: Path, name: str) -> Path:
    folder = tmp_path / name
    shutil.copytree(TINY / name, folder)
    return folder


def with_config(tmp_path: Path, name: str, **changes) -> Path:
    folder = copy_of(tmp_path, name)
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not ...}))
    return folder


def with_tensors(tmp_path: Path, name: str, change) -> Path:
    folder = copy_of(tmp_path, name)
    tensors = mx.load(str(folder / "model.safetensors"))
    mx.save_safetensors(str(folder / "model.safetensors"), change(tensors))
    return folder


def without(key: str):
    return lambda tensors: {k: v for k, v in tensors.items() if k != key}


def extra_expert(mlp: str, count: int):
    """Experts `count`.. added to every projection of `mlp` (copies of expert 0)."""

    def change(tensors):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            for e in range(4, count):
                tensors[f"{mlp}.experts.{e}.{proj}.weight"] = tensors[f"{mlp}.experts.0.{proj}.weight"]
        return tensors

    return change


def resized(key: str, rows: int):
    return lambda tensors: {**tensors, key: mx.concatenate([tensors[key]] * 2)[:rows]}


# (fixture, how it is damaged, the one line's words, " * " between parts that may have words between them).
# Damage: a config change (dict) or a tensor change. The first router is also checked from the headers alone
# (sizing.py), before the model is built; the others when their layout is converted (moe_weights.py).
MALFORMED = [
    ("qwen3_moe", without("model.layers.0.mlp.experts.3.up_proj.weight"),
     "num_experts is 4 but model.layers.0.mlp.experts.*.up_proj holds experts 0 to 2 (3 in all)"),
    ("olmoe", extra_expert("model.layers.2.mlp", 6),
     "num_experts is 4 but model.layers.2.mlp.experts.*.down_proj holds experts 0 to 5 (6 in all)"),
    ("mixtral", {"num_local_experts": 8},
     "num_local_experts is 8 but * block_sparse_moe.gate.weight has shape (4, 64)"),
    ("qwen3_5_moe", resized("model.layers.1.mlp.gate.weight", 3),
     "num_experts is 4 but the router model.layers.1.mlp.gate.weight has shape (3, 64)"),
    ("granitemoe", resized("model.layers.3.block_sparse_moe.input_linear.weight", 3),
     "num_local_experts is 4 but model.layers.3.block_sparse_moe.input_linear.weight has shape (3, 48, 64)"),
    ("olmoe", {"num_experts_per_tok": 5}, "num_experts_per_tok must be from 1 to num_experts=4, got 5"),
    ("granitemoe", {"num_experts_per_tok": 0}, "num_experts_per_tok must be from 1 to num_local_experts=4, got 0"),
    ("mixtral", {"num_local_experts": 0}, "num_local_experts must be an integer from 1 to 65536, got 0"),
    ("qwen3_5_moe", {"num_experts": 0}, "num_experts must be an integer from 1 to 65536, got 0"),
    ("qwen3_moe", {"num_experts": 8}, "num_experts=8 and num_local_experts=4 disagree"),
]  # fmt: skip


def damaged(tmp_path: Path, name: str, damage) -> Path:
    if isinstance(damage, dict):
        return with_config(tmp_path, name, **damage)
    return with_tensors(tmp_path, name, damage)


@pytest.mark.parametrize(("name", "damage", "words"), MALFORMED)
def test_malformed_moe_input_is_one_line_and_converts_nothing(name, damage, words, tmp_path):
    folder = damaged(tmp_path, name, damage)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["convert", str(folder), "-o", str(out), "--bits", "8", "--no-eval"])
    assert result.exit_code == 1, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    pattern = ".*".join(map(re.escape, words.split(" * ")))
    assert len(errors) == 1 and re.search(pattern, errors[0]), result.stderr
    assert not out.exists()
    with pytest.raises((ConfigError, WeightMismatchError), match=pattern):
        mlxinfer.load(folder)


def test_qwen3_moe_reads_the_hubs_num_experts_key(tmp_path):
    # Qwen/Qwen3-30B-A3B's config.json says num_experts; transformers 5 writes num_local_experts.
    folder = with_config(tmp_path, "qwen3_moe", num_experts=4, num_local_experts=...)
    assert max_diff(mlxinfer.load(folder), "qwen3_moe") < 1e-3


def test_qwen3_moe_slides_every_layer_and_only_with_use_sliding_window():
    raw = json.loads((TINY / "qwen3_moe_sliding" / "config.json").read_text())
    assert raw["max_window_layers"] == 2  # transformers' Qwen3-MoE does not read it
    assert normalize_config(raw).layer_types == (SLIDING,) * 4
    assert SLIDING not in normalize_config({**raw, "use_sliding_window": False}).layer_types


@pytest.mark.parametrize(
    ("name", "changes", "words"),
    [
        ("qwen3_moe", {"attention_bias": True}, "attention_bias=True is not supported"),
        ("qwen3_moe", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "rope type"),
        ("mixtral", {"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope type 'linear' is not supported"),
        ("olmoe", {"clip_qkv": 8.0}, "clip_qkv=8.0 is not supported"),
        ("olmoe", {"mlp_bias": True}, "mlp_bias=True is not supported"),
    ],
)
def test_settings_mlx_lm_would_ignore_are_refused(name, changes, words, tmp_path):
    with pytest.raises(UnsupportedModelError, match=words):
        mlxinfer.load(with_config(tmp_path, name, **changes))


@pytest.mark.parametrize(
    "key", ["embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling"]
)
def test_granitemoe_multipliers_must_be_positive(key, tmp_path):
    with pytest.raises(ConfigError, match=f"{key} must be a positive finite number, got 0"):
        mlxinfer.load(with_config(tmp_path, "granitemoe", **{key: 0}))


def fused(tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    """Qwen3.5-MoE's experts as the Hub checkpoints store them: gate_up_proj (E, 2I, H), down_proj (E, H, I)."""
    out = dict(tensors)
    for layer in range(4):
        mlp = f"model.layers.{layer}.mlp.experts"
        gate, up, down = (
            [out.pop(f"{mlp}.{e}.{p}.weight") for e in range(4)] for p in ("gate_proj", "up_proj", "down_proj")
        )
        out[f"{mlp}.gate_up_proj"] = mx.concatenate([mx.stack(gate), mx.stack(up)], axis=1)
        out[f"{mlp}.down_proj"] = mx.stack(down)
    return out


def test_qwen3_5_moe_reads_fused_experts(tmp_path):
    # transformers 5 loads this layout too (checked: 3.5e-6 from golden.safetensors).
    assert max_diff(mlxinfer.load(with_tensors(tmp_path, "qwen3_5_moe", fused)), "qwen3_5_moe") < 1e-3


def test_qwen3_5_moe_always_renormalizes_its_top_k(tmp_path):
    # transformers' Qwen3.5-MoE router reads no norm_topk_prob; mlx-lm's block would obey one.
    folder = with_config(tmp_path, "qwen3_5_moe", norm_topk_prob=False)
    assert max_diff(mlxinfer.load(folder), "qwen3_5_moe") < 1e-3


def test_the_qwen3_5_moe_vision_language_form_runs_its_text_model(tmp_path):
    """model_type qwen3_5_moe with text_config and language_model tensors (fused, as on the Hub), vision skipped."""
    folder = copy_of(tmp_path, "qwen3_5_moe")
    text = json.loads((folder / "config.json").read_text())
    outer = {"model_type": "qwen3_5_moe", "text_config": text, "vision_config": {"depth": 1},
             "tie_word_embeddings": False, "eos_token_id": text["eos_token_id"]}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(outer))
    tensors = fused(mx.load(str(folder / "model.safetensors")))
    renamed = {k if k.startswith("lm_head.") else k.replace("model.", "model.language_model.", 1): v
               for k, v in tensors.items()}  # fmt: skip
    renamed["model.visual.patch_embed.proj.weight"] = mx.zeros((16, 3, 2, 4, 4))
    mx.save_safetensors(str(folder / "model.safetensors"), renamed)
    model = mlxinfer.load(folder)
    assert model._loaded.config.model_type == "qwen3_5_moe_text"
    assert max_diff(model, "qwen3_5_moe") < 1e-3


def test_converted_qwen3_5_moe_says_mlx_lms_model_type_and_loads_as_ours(tmp_path):
    out = tmp_path / "out"
    convert(TINY / "qwen3_5_moe", out, bits=16, dtype="float32", evaluate=False, progress=False)
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3_5_moe"  # mlx-lm's module
    model = mlxinfer.load(out)
    assert model._loaded.config.model_type == "qwen3_5_moe_text"
    assert max_diff(model, "qwen3_5_moe") < 1e-3
