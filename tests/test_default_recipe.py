"""The converter's default recipe (convert/default_recipe.py): the learned 4-bit recipe when no flag picks one and
the source and machine allow it, else round-to-nearest with the reason. The README's real-model run of the default
(it answers "Paris") is in test_convert.py."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from mlxinfer.convert import ConvertSettings, convert
from mlxinfer.convert.default_recipe import choose

import mlxinfer
from mlxinfer.cli import main
from mlxinfer.memory import MachineMemory
from mlxinfer.models.config import normalize_config
from tests.conftest import TINY

GiB = 1 << 30
ROOMY = MachineMemory(64 * GiB, 64 * GiB, 0, "cpu", None, None)


def config(name: str):
    return normalize_config(json.loads((TINY / name / "config.json").read_text()))


def chosen(settings: ConvertSettings, name: str = "llama_classic", moe=False, gguf_blocks=False, peak=GiB):
    return choose(settings, config(name), 135_000_000, moe, gguf_blocks, peak, "src")


@pytest.fixture(autouse=True)
def roomy_machine(monkeypatch):
    monkeypatch.setattr("mlxinfer.models.sizing.machine_memory", lambda: ROOMY)


@pytest.mark.parametrize(
    "flags",
    [dict(bits=8), dict(group_size=64), dict(method="rtn"), dict(method="gptq"), dict(recipe="uniform"),
     dict(bpw=5.0), dict(recipe="mixed-4-8"), dict(mode="nvfp4"), dict(bits=16)],
)  # fmt: skip
def test_any_flag_that_picks_a_recipe_is_taken_as_given(flags):
    settings = ConvertSettings(**flags)
    assert chosen(settings) is None and settings == ConvertSettings(**flags)


@pytest.mark.parametrize("bits", [None, 4])
def test_no_recipe_flag_on_a_verified_dense_model_picks_the_learned_recipe(bits):
    settings = ConvertSettings(bits=bits)
    choice = chosen(settings)
    assert choice.learned and "the learned default --recipe sensitivity --bpw 4.75 --method dwq" in choice.note
    assert "; about 5 min on a 2-core CPU at 36 min per billion parameters; --method rtn takes seconds" in choice.note
    assert (settings.recipe, settings.bpw, settings.method, settings.calibration) == (
        "sensitivity",
        4.75,
        "dwq",
        "mixed",
    )


def test_a_given_calibration_is_kept():
    settings = ConvertSettings(calibration="prose")
    assert chosen(settings).learned and settings.calibration == "prose"


@pytest.mark.parametrize(
    "case, reason",
    [
        (dict(gguf_blocks=True), "the GGUF file's own quantized blocks are kept"),
        (dict(name="qwen3_next"), "model_type 'qwen3_next' has recurrent layers"),
        (dict(name="qwen3_moe", moe=True), "the experts of model_type 'qwen3_moe' cannot be calibrated yet"),
        (dict(peak=80 * GiB), "the learned 4-bit recipe's calibration need 81,920 MiB but this machine can hold"),
    ],
)
def test_what_rules_the_learned_recipe_out_is_named_and_rounds_to_nearest(case, reason):
    settings = ConvertSettings()
    choice = chosen(settings, **case)
    assert not choice.learned and choice.note.startswith("round-to-nearest, not the learned default: ")
    assert reason in choice.note and "src:" not in choice.note
    assert (settings.method, settings.recipe, settings.bpw) == ("rtn", None, None)


def test_an_unverified_family_rounds_to_nearest():
    raw = json.loads((TINY / "llama_classic" / "config.json").read_text()) | {"model_type": "starcoder2"}
    settings = ConvertSettings()
    choice = choose(settings, normalize_config(raw), 10**9, False, False, GiB, "src")
    assert not choice.learned and "model_type 'starcoder2' is unverified" in choice.note


@pytest.mark.slow  # a whole conversion with the learned recipe, on the tiny model: ~3 s
def test_the_default_converts_end_to_end_and_the_plan_line_says_so(tmp_path):
    result = CliRunner().invoke(main, ["convert", str(TINY / "qwen2"), "-o", str(tmp_path / "o"), "--no-eval"])
    assert result.exit_code == 0, result.output
    plan = next(line for line in result.stderr.splitlines() if "expected peak memory" in line)
    assert "4-bit dwq (the learned default --recipe sensitivity --bpw 4.75" in plan
    manifest = json.loads((tmp_path / "o" / "mlxinfer-manifest.json").read_text())
    assert manifest["settings"]["method"] == "dwq" and manifest["bits_per_weight"] <= 4.75
    assert mlxinfer.load(tmp_path / "o").generate("hello", max_tokens=3).stats.generated_tokens == 3


def test_a_fallback_is_said_on_the_plan_line(tmp_path):
    result = convert(TINY / "qwen3_moe", tmp_path / "o", evaluate=False, progress=False)
    assert result.manifest["settings"]["method"] == "rtn"
    result = CliRunner().invoke(main, ["convert", str(TINY / "qwen3_next"), "-o", str(tmp_path / "n"), "--no-eval"])
    assert result.exit_code == 0, result.output
    assert (
        "4-bit rtn (round-to-nearest, not the learned default: model_type 'qwen3_next' has recurrent" in result.stderr
    )


@pytest.mark.slow  # a whole conversion with the learned recipe, on the tiny model: ~3 s
def test_a_base_model_without_a_chat_template_takes_the_default_with_its_chat_seeds_as_text(tmp_path):
    import shutil

    from mlxinfer.convert.calibration import SELF_PROMPTS, calibration_ids

    from mlxinfer.models.loader import load_model

    base = tmp_path / "base"
    shutil.copytree(TINY / "qwen2", base)
    tokenizer_config = json.loads((base / "tokenizer_config.json").read_text())
    del tokenizer_config["chat_template"]
    (base / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    loaded = load_model(base)
    samples, per = calibration_ids(loaded, "mixed", 512)[256:], 256 // len(SELF_PROMPTS)
    seed = SELF_PROMPTS[0][0]["content"]  # a chat seed, read as plain text: the sample opens with its words
    assert samples[:4] == loaded.tokenizer.encode(seed, add_special_tokens=False)[:4] and per > 4
    result = CliRunner().invoke(main, ["convert", str(base), "-o", str(tmp_path / "o"), "--no-eval"])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "o" / "mlxinfer-manifest.json").read_text())["settings"]["method"] == "dwq"
