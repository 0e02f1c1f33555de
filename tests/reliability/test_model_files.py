"""Hostile model files: config.json sizes, GGUF metadata, tensor names, tokenizer files.

Each case is generated (fields x values, keys x wrong types, names x formats) and must
end in one MlxInferError whose one-line message names the file and the field, within
LIMIT_S and LIMIT_BYTES: nothing large is built or read before the input is checked.

Where the rule is a pure function of config.json or of a GGUF header (the normalizer, the header
checks), every case is checked on that function in one test, in about a second; a sample of the
cases (the largest, and one of each kind of outcome) still runs end to end through load_model,
with the time and memory bounds.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import json
import math
import shutil
import struct
import time
import tracemalloc
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner

from mlxinfer.cli import main
from mlxinfer.errors import (
    ChatTemplateError,
    ConfigError,
    CorruptFileError,
    MemoryBudgetError,
    MlxInferError,
    TokenizerError,
    UnsupportedModelError,
    WeightMismatchError,
)
from mlxinfer.formats.gguf_file import MAX_DEPTH, GGUFFile
from mlxinfer.memory import MachineMemory
from mlxinfer.models.checkpoint import Checkpoint, open_folder
from mlxinfer.models.config import ModelConfig, normalize_config
from mlxinfer.models.dtype import choose_compute_dtype
from mlxinfer.models.fallback import _check_args as check_fallback_args
from mlxinfer.models.gguf import gguf_config, gguf_tensors
from mlxinfer.models.loader import _folder_tensors as folder_tensors
from mlxinfer.models.loader import load_model
from mlxinfer.models.mlx_lm_modules import model_module
from mlxinfer.models.sizing import check_before_build
from mlxinfer.tokenizer.gguf_vocab import tokenizer_from_gguf
from mlxinfer.tokenizer.tokenizer import MAX_TOKENIZER_BYTES
from tests.conftest import TINY
from tests.test_gguf import gguf_name, llama_cpp_permute

LIMIT_S = 10.0  # each refusal takes under 0.1 s here; unrefused, the largest case would build for minutes
LIMIT_BYTES = 64 << 20
V = gguf.GGUFValueType


def refused(call: Callable[[], Any], error: type[MlxInferError], *words: str) -> str:
    """Run `call`; it must raise `error` quickly, allocating little, with one short line naming `words`."""
    mx.reset_peak_memory()
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(error) as info:
            call()
    finally:
        elapsed, (_, peak) = time.perf_counter() - start, tracemalloc.get_traced_memory()
        tracemalloc.stop()
    message = str(info.value)
    assert elapsed < LIMIT_S, f"took {elapsed:.2f}s: {message}"
    assert peak < LIMIT_BYTES and mx.get_peak_memory() < LIMIT_BYTES, (peak, mx.get_peak_memory(), message)
    assert "\n" not in message and len(message) < 1000, message
    for word in words:
        assert word in message, (word, message)
    return message


def nested(depth: int, leaf: Any = 1) -> list:
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


# -- config.json ------------------------------------------------------------------------------

SIZE_FIELDS = [
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_hidden_layers",
]
# Wrong types, signs and overflows: refused for every size field.
BAD_SIZES = [0, -1, 2**31, 2**63, 10**12, 10**6 * 2**31, 1.5, 64.0, True, False, "64", [64], {"n": 64}]
# Valid numbers that this checkpoint's tensors contradict (10**4 layers: the most a config may ask for).
WRONG_SIZES = {
    "vocab_size": [300, 100_000],
    "hidden_size": [32, 128, 2**20],
    "intermediate_size": [64, 256, 2**24],
    "num_attention_heads": [8, 2**16],
    "num_key_value_heads": [1, 4],
    "head_dim": [8, 32, 2**20],
    "num_hidden_layers": [1, 3, 10_000],
}


def copy_with_config(tmp_path: Path, name: str, change: Callable[[dict], None]) -> Path:
    folder = tmp_path / name
    shutil.copytree(TINY / name, folder, ignore=shutil.ignore_patterns("golden.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    change(config)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def setter(path: str, value: Any) -> Callable[[dict], None]:
    """Set a dotted path in a config dict ("rope_parameters.factor")."""

    def change(config: dict) -> None:
        *parents, last = path.split(".")
        for key in parents:
            config = config[key]
        config[last] = value

    return change


@functools.cache
def fixture_checkpoint(name: str) -> Checkpoint:
    return open_folder(
        TINY / name
    )  # config.json as load_model reads it (generation_config's eos merged) and the headers


def one_line_naming(error: Exception, *words: str) -> str | None:
    """Why `error`'s message is not one short line naming every word; None where it is."""
    message = str(error)
    if "\n" in message or len(message) >= 1000:
        return f"not one short line: {message[:300]!r}"
    missing = [word for word in words if word not in message]
    return f"{type(error).__name__} does not name {missing}: {message}" if missing else None


def config_refusal(name: str, field: str, value: Any, error: type[MlxInferError] = MlxInferError) -> str | None:
    """Why the normalizer does not refuse `value` at `field` of fixture `name` with `error`, in one line naming the
    field and config.json; None where it does. (The end-to-end cases below show load_model refuses as it does.)"""
    try:
        normalized(edited(fixture_checkpoint(name).config, field, value), name)
    except MlxInferError as e:
        if not isinstance(e, error):
            return f"{type(e).__name__} instead of {error.__name__}: {e}"
        return one_line_naming(e, field.split(".")[-1], "config.json")
    except Exception as e:  # noqa: BLE001 - a crash is a failure of this case, named with it
        return f"{type(e).__name__}, not an MlxInferError: {e}"
    return "accepted"


def test_bad_size_in_config_is_refused_by_name_on_the_normalizer():
    failures = [
        f"{field}={value!r}: {why}"
        for field in SIZE_FIELDS
        for value in BAD_SIZES
        if (why := config_refusal("llama_classic", field, value, ConfigError))
    ]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("field, value", [(field, max(BAD_SIZES[:6])) for field in SIZE_FIELDS] + [("head_dim", "64")])
def test_bad_size_in_config_is_refused_by_name(tmp_path, field, value):
    """End to end, the largest of each (and one of the wrong types): refused within the time and memory bounds."""
    folder = copy_with_config(tmp_path, "llama_classic", setter(field, value))
    refused(lambda: load_model(folder), ConfigError, field, "config.json")


def contradicted(name: str, field: str, value: int) -> dict:
    config = edited(fixture_checkpoint(name).config, field, value)
    if field == "num_hidden_layers" and "layer_types" in config:
        config["layer_types"] = (config["layer_types"] * value)[:value]
    return config


CONTRADICTED = [
    (name, field, value)
    for name in ["llama_classic", "phi3", "qwen2", "gemma3"]
    for field, values in WRONG_SIZES.items()
    for value in values
    if field != "head_dim" or "head_dim" in fixture_checkpoint(name).config  # else derived from hidden_size
]


def test_size_the_checkpoint_contradicts_is_refused_before_building_on_the_headers():
    """normalize_config, then check_before_build against the checkpoint's tensor headers: what load_model runs before
    it builds anything."""
    failures = []
    for name, field, value in CONTRADICTED:
        folder = str(TINY / name)
        try:
            config = normalize_config(contradicted(name, field, value), source=f"{folder}/config.json")
            check_before_build(config, folder_tensors(fixture_checkpoint(name), choose_compute_dtype()), folder)
        except MlxInferError as e:
            why = one_line_naming(e, field, folder)
        except Exception as e:  # noqa: BLE001 - a crash is a failure of this case, named with it
            why = f"{type(e).__name__}, not an MlxInferError: {e}"
        else:
            why = "accepted"
        if why:
            failures.append(f"{name} {field}={value}: {why}")
    assert len(CONTRADICTED) > 60 and not failures, "\n".join(failures)


@pytest.mark.parametrize(
    "name, field, value",
    [("llama_classic", field, max(values)) for field, values in WRONG_SIZES.items()]
    + [(name, "num_hidden_layers", 10_000) for name in ("phi3", "qwen2", "gemma3")],
)
def test_size_the_checkpoint_contradicts_is_refused_before_building(tmp_path, name, field, value):
    """End to end, the largest value of each field (and the most layers for each family): refused within the bounds."""

    def change(config: dict) -> None:
        config.update(contradicted(name, field, value))

    folder = copy_with_config(tmp_path, name, change)
    refused(lambda: load_model(folder), MlxInferError, field, str(folder))


@pytest.mark.parametrize("field, value", [("num_hidden_layers", 3), ("hidden_size", 128), ("intermediate_size", 64)])
@pytest.mark.parametrize("source", ["folder", "gguf"])
def test_conversion_sizes_the_source_before_building(tmp_path, source, field, value):
    from mlxinfer.convert import ConvertSettings, plan_conversion

    if source == "folder":
        src = copy_with_config(tmp_path, "llama_classic", setter(field, value))
    else:
        key = {"num_hidden_layers": "llama.block_count", "hidden_size": "llama.embedding_length"}
        key["intermediate_size"] = "llama.feed_forward_length"
        src = write_gguf(tmp_path / "src.gguf", {key[field]: (value, V.UINT32)})
    out = tmp_path / "out"
    refused(lambda: plan_conversion(src, out, ConvertSettings()), WeightMismatchError, field, str(src))
    assert not out.exists()


# (fixture, dotted field, value): numbers outside their meaning, wrong types, non-finite floats.
OTHER_FIELDS = [
    *[("llama_classic", "max_position_embeddings", v) for v in (0, -1, 2**31, 1.5, True, "256", [256])],
    *[("llama_classic", "rms_norm_eps", v) for v in (0, -1e-6, 2.0, math.nan, math.inf, True, "1e-6", [1e-6])],
    *[("llama_classic", "rope_theta", v) for v in (0, -1.0, math.nan, math.inf, -math.inf, True, "1e4", {})],
    *[("llama_tf5", "rope_parameters.rope_theta", v) for v in (0, -1.0, math.nan, math.inf, False, "1e4", [1])],
    *[("llama_rope_linear", "rope_scaling.factor", v) for v in (0, -4.0, math.nan, math.inf, True, "4", [4])],
    *[("llama_rope_llama3", "rope_parameters.factor", v) for v in (0, -8.0, math.nan, True, "8")],
    *[("llama_rope_llama3", "rope_parameters.low_freq_factor", v) for v in (0, -1.0, 4.0, 9.0, math.nan, "1")],
    *[("llama_rope_llama3", "rope_parameters.high_freq_factor", v) for v in (0, 1.0, 0.5, math.inf, True)],
    *[
        ("llama_rope_llama3", "rope_parameters.original_max_position_embeddings", v)
        for v in (0, -64, 2**31, 64.5, True, "64")
    ],
    *[("mistral", "sliding_window", v) for v in (0, -8, 2**31, 8.5, True, "8", [8])],
    *[("gemma3", "sliding_window", v) for v in (0, -8, None)],
    *[("gemma3", "sliding_window_pattern", v) for v in (0, -6, 10**6, 6.0, True, "6")],
    *[("qwen2", "max_window_layers", v) for v in (-1, 2**31, 1.5, True, "28")],
    *[("phi3", "rope_parameters.partial_rotary_factor", v) for v in (0, -0.5, 2.0, math.nan, True)],
    *[("gemma2", "query_pre_attn_scalar", v) for v in (0, -16, math.inf, True, "16")],
    *[("gemma2", "attn_logit_softcapping", v) for v in (0, -50.0, math.nan, True, "50")],
    *[("gemma2", "final_logit_softcapping", v) for v in (0, -30.0, math.inf, "30")],
    *[("gemma3", "layer_types", v) for v in ([1] * 6, [{}] * 6, [[]] * 6, ["full_attention"] * 10**5, "full")],
    *[("gemma3", "rope_parameters.full_attention", v) for v in ("x", 5, [1])],
    *[("llama_classic", "tie_word_embeddings", v) for v in ("false", 1, 0, [True])],
    *[("llama_classic", "attention_bias", v) for v in ("false", 1)],
    *[("llama_classic", "hidden_act", v) for v in (5, ["silu"], {"name": "silu"})],
    *[("llama_classic", "model_type", v) for v in (5, ["llama"], {"t": 1}, None, "x" * 10**5)],
    *[("llama_classic", "bos_token_id", v) for v in (-1, 272, 2**40, 1.5, True, "256", [256], {"id": 1})],
    *[("llama_classic", "eos_token_id", v) for v in (-1, 272, 2**63, 2.0, False, "258", [258, "x"], [[258]])],
    ("llama_classic", "eos_token_id", list(range(257)) * 4),
    *[("llama_classic", field, 10**400) for field in ("rms_norm_eps", "rope_theta")],  # no float holds it
    ("gemma2", "final_logit_softcapping", -(10**400)),
]


def test_nonsense_config_value_is_refused_by_name_on_the_normalizer():
    failures = [
        f"{name} {field}={value!r:.60}: {why}"
        for name, field, value in OTHER_FIELDS
        if (why := config_refusal(name, field, value))
    ]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize(
    "name, field, value", [case for case in OTHER_FIELDS if len(repr(case[2])) > 300], ids=lambda v: repr(v)[:40]
)
def test_nonsense_config_value_is_refused_by_name(tmp_path, name, field, value):
    """End to end, the largest values (10**400, 100,000 layer kinds, a 100,000-character model_type, 1,028 eos ids)."""
    folder = copy_with_config(tmp_path, name, setter(field, value))
    refused(lambda: load_model(folder), MlxInferError, field.split(".")[-1], "config.json")


# -- null numbers in config.json: the rule is a pure function of the config, checked there for every case ----------

# Every number config.json gives us, top level and nested; null_cases sets each to null in every fixture (a nested one
# only where its section exists), and for gemma3 and qwen2 once more with the layer kinds derived from the settings.
NUMERIC_FIELDS = [
    *SIZE_FIELDS,
    *["max_position_embeddings", "original_max_position_embeddings", "sliding_window", "sliding_window_pattern"],
    *["max_window_layers", "rms_norm_eps", "rope_theta", "rope_local_base_freq", "partial_rotary_factor"],
    *["query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"],
    *["bos_token_id", "eos_token_id", "pad_token_id"],
    *["rope_parameters." + k for k in ("rope_theta", "partial_rotary_factor", "factor", "low_freq_factor")],
    *["rope_parameters." + k for k in ("high_freq_factor", "original_max_position_embeddings")],
    *["rope_parameters.full_attention.rope_theta", "rope_parameters.sliding_attention.rope_theta"],
    "rope_scaling.factor",
]
# Without layer_types the sliding settings decide which layers slide (gemma3's pattern, qwen's max_window_layers).
DERIVED_LAYERS = {"gemma3": {}, "qwen2": {"use_sliding_window": True, "sliding_window": 8}}

# What a null means, pinned. Null is the default for these, and the default is transformers': LlamaConfig.__init__
# turns a null num_key_value_heads into num_attention_heads and a null head_dim into hidden_size // num_attention_heads,
# and Gemma3TextConfig's sliding_window_pattern is 6 (config.py writes the same: "absent or null", _NULL_IS_DEFAULT).
NULL_DEFAULTS: dict[str, Callable[[dict], Any]] = {
    "num_key_value_heads": lambda config: config["num_attention_heads"],
    "head_dim": lambda config: config["hidden_size"] // config["num_attention_heads"],
    "sliding_window_pattern": lambda config: 6,
}
# Null is "none" for these: no token, no soft cap (transformers: `if config.final_logit_softcapping is not None`;
# config.py's _NULL_IS_OFF), no declared context length, no window, no count of full layers.
NULL_IS_NONE = frozenset(
    {"bos_token_id", "eos_token_id", "pad_token_id", "attn_logit_softcapping", "final_logit_softcapping",
     "max_position_embeddings", "original_max_position_embeddings", "sliding_window", "max_window_layers"}
)  # fmt: skip
# Every other number is refused by name (a ConfigError naming it and config.json): a size, an epsilon, a RoPE base or a
# RoPE scale has no "off" (config.py: "for the numbers below that have no 'off', null is refused"). Where a family
# takes the value from elsewhere (a wrapper's text_config, rope_parameters' own rope_theta), the null is not read.
NO_OFF = ("rms_norm_eps", "rope_theta", "rope_local_base_freq", "partial_rotary_factor", "query_pre_attn_scalar")
UNVERIFIED = frozenset({"afmoe", "lfm2_moe", "starcoder2"})  # mlx-lm's own module runs these (models/fallback.py)
UNVERIFIED_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers")  # what the engine reads of those itself
PER_LAYER_ROPE = ("gemma3_text", "olmo3")  # these read rope_parameters' full/sliding sections, not its top keys
Outcome = tuple[str, Any]  # ("refused", error class), ("default", value), ("none", None) or ("ignored", None)


def rope_kind(section: dict) -> str:
    return section.get("rope_type") or section.get("type") or "default"


def typed_in_mlx_lm(model_type: str) -> set[str]:
    """The numbers (and bools) that mlx-lm's ModelArgs for `model_type` declares: they take no null."""
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    kinds = (int, float, bool, "int", "float", "bool")
    return {f.name for f in dataclasses.fields(module.ModelArgs) if f.type in kinds}


def null_expected(config: dict, field: str) -> Outcome:
    """What a null at `field` must do to `config`: the rules above, with each family's own reading of the field."""
    *parents, key = field.split(".")
    model_type, rope = config["model_type"], config.get("rope_parameters") or {}
    refused: Outcome = ("refused", ConfigError)
    if "text_config" in config:  # a vision-language wrapper: its top-level numbers are not its text model's
        return ("ignored", None)
    if model_type in UNVERIFIED:  # fallback._check_args: no null where mlx-lm declares a number
        if not parents and (key in typed_in_mlx_lm(model_type) or key in NO_OFF or key in UNVERIFIED_SIZES):
            return refused
        if parents == ["rope_parameters"] and key in ("rope_theta", "partial_rotary_factor") and key not in config:
            return refused  # copied up to the top-level key that mlx-lm reads (config._classic_rope_keys)
        return ("none", None) if not parents else ("ignored", None)
    sections = [config.get("rope_scaling") or {}, rope, *(v for v in rope.values() if isinstance(v, dict))]
    yarn = any(rope_kind(section) == "yarn" for section in sections)
    if not parents:
        layers = config.get("layer_types")
        if layers is None and model_type == "gemma3_text":  # Gemma3's pattern: every 6th layer is full
            layers = ["sliding_attention" if (i + 1) % 6 else "full" for i in range(config["num_hidden_layers"])]
        if key in NULL_DEFAULTS:
            return ("default", NULL_DEFAULTS[key](config))
        if key == "attn_logit_softcapping" and model_type == "gemma2":
            return ("refused", UnsupportedModelError)  # the registry: gemma2's attention requires its cap
        if key == "sliding_window" and "sliding_attention" in (layers or ()):
            return refused  # sliding layers need their window
        if key == "max_window_layers" and model_type == "qwen2" and config.get("use_sliding_window"):
            return refused  # Qwen2Config counts the full layers with it
        if key == "original_max_position_embeddings" and yarn:
            return refused  # yarn.py: the top-level one wins over the scaling's, as in transformers
        if key in NULL_IS_NONE:
            return ("none", None)
        if key == "rope_theta" and ("rope_theta" in rope or model_type in PER_LAYER_ROPE):
            return ("ignored", None)  # the base comes from rope_parameters
        if key == "rope_local_base_freq" and model_type == "gemma3_text":
            return ("ignored", None)  # the sliding section's rope_theta is the local base
        if key == "partial_rotary_factor" and "partial_rotary_factor" in rope:
            return ("ignored", None)
        if key == "partial_rotary_factor" and model_type != "gemma3_text":
            return ("refused", UnsupportedModelError)  # a family without partial RoPE refuses any value but 1.0
        return refused
    if parents[-1] in ("full_attention", "sliding_attention"):  # one layer type's RoPE base
        return ("refused", UnsupportedModelError) if model_type == "olmo3" else refused  # olmo3 runs one base
    if key in ("rope_theta", "partial_rotary_factor"):
        return ("ignored", None) if model_type in PER_LAYER_ROPE else refused
    section = config[parents[0]]
    kind = rope_kind(section)
    if kind == "default":
        return ("ignored", None)  # plain RoPE reads no scale
    if kind == "yarn" and key == "factor":  # transformers' _compute_yarn_parameters, for a missing factor
        original = config.get("original_max_position_embeddings") or section["original_max_position_embeddings"]
        return ("default", config["max_position_embeddings"] / original)
    if kind == "yarn" and key in ("low_freq_factor", "high_freq_factor"):
        return ("refused", UnsupportedModelError)  # yarn.py: a key transformers' YaRN does not read is refused
    return refused  # linear's factor, llama3's four settings, yarn's original_max_position_embeddings


def null_cases() -> list[tuple[str, str, bool]]:
    cases = []
    for name in sorted(p.name for p in TINY.iterdir() if p.is_dir()):
        config = json.loads((TINY / name / "config.json").read_text())
        for field in NUMERIC_FIELDS:
            *parents, _ = field.split(".")
            inner = config
            for key in parents:
                inner = inner.get(key) if isinstance(inner, dict) else None
            if isinstance(inner, dict):  # a nested field only where its section exists
                cases += [(name, field, False)] + [(name, field, True)] * (name in DERIVED_LAYERS)
    return cases


def derive(config: dict, name: str, derived: bool) -> dict:
    config = copy.deepcopy(config)
    if derived:
        config.pop("layer_types", None)
        config.update(DERIVED_LAYERS[name])
    return config


def edited(config: dict, field: str, value: Any = None, drop: bool = False) -> dict:
    """A copy of `config` with the dotted `field` set to `value` (or removed); as it is if a section is missing."""
    config = copy.deepcopy(config)
    *parents, last = field.split(".")
    inner = config
    for key in parents:
        inner = inner.get(key) if isinstance(inner, dict) else None
    if isinstance(inner, dict):
        if drop:
            inner.pop(last, None)
        else:
            inner[last] = value
    return config


def normalized(config: dict, name: str) -> ModelConfig:
    """What load_model makes of `config` before it builds anything: normalize_config, and for a model_type that only
    mlx-lm runs, the check of mlx-lm's ModelArgs that build_fallback makes first."""
    normal = normalize_config(config, source=str(TINY / name / "config.json"))
    if normal.fallback_module is not None:
        check_fallback_args(model_module(normal.fallback_module).ModelArgs, normal.args, normal.source)
    return normal


def seen(normal: ModelConfig, leave_out: str = "") -> tuple:
    """What the runtime reads of a normalized config, a null read as absent, the dotted key `leave_out` left out."""

    def clean(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items() if v is not None}
        return [clean(v) for v in value] if isinstance(value, list) else value

    args = edited(clean(normal.args), leave_out, drop=True) if leave_out else clean(normal.args)
    return args, normal.layer_types, normal.sliding_window, normal.eos_token_ids, normal.bos_token_id


def null_mismatch(config: dict, name: str, field: str) -> str | None:
    """How the normalizer's answer to a null at `field` differs from null_expected; None where it does not."""
    expected = null_expected(config, field)
    try:
        normal = normalized(edited(config, field, None), name)
    except MlxInferError as e:
        message = str(e)
        if expected != ("refused", type(e)):
            return f"expected {expected}, got {type(e).__name__}: {message}"
        named = field.split(".")[-1] in message and "config.json" in message and "\n" not in message
        return None if named else f"the refusal does not name {field} and config.json in one line: {message}"
    except Exception as e:  # noqa: BLE001 - a crash is a failure of this case, named with it
        return f"expected {expected}, got {type(e).__name__} (not an MlxInferError): {e}"
    if expected[0] == "refused":
        return f"expected {expected[1].__name__}, but the null was accepted"
    if expected[0] == "ignored":  # the value comes from elsewhere: as if the key were not there
        absent = normalized(edited(config, field, drop=True), name)
        return None if seen(normal) == seen(absent) else "expected the null to be read as absent"
    if expected[0] == "none":
        if normal.args.get(field) is not None:
            return f"expected no value, got {normal.args.get(field)!r}"
        mine, absent = seen(normal, field), seen(normalized(edited(config, field, drop=True), name), field)
        if field == "sliding_window":  # no window: no sliding layers, whatever a missing one would default to
            slides = normal.sliding_window is not None or "sliding_attention" in normal.layer_types
            mine, absent = (slides, mine[0], mine[3:]), (False, absent[0], absent[3:])
        return None if mine == absent else f"the null changed more than {field}"
    value = expected[1]  # the default: the null must read exactly as that value written out
    written = normalized(edited(config, field, value), name)
    if field == "sliding_window_pattern":  # read into the layer kinds, then dropped
        got = normal.layer_types
        ok = got == written.layer_types and seen(normal, field) == seen(written, field)
    elif field.endswith("factor"):  # YaRN's: read into the resolved scaling
        got = normal.args["rope_scaling"]["factor"]
        ok = got == value and normal.args["rope_scaling"] == written.args["rope_scaling"]
    else:
        got = normal.args[field]
        ok = got == value and seen(normal) == seen(written)
    return None if ok else f"expected the default {value!r}, got {got!r}"


NULL_CASES = null_cases()


def test_null_number_in_config_is_its_pinned_default_or_refused_by_name():
    """Every (fixture x numeric field [x derived layers]) on the normalizer: about 1,200 cases in a second."""
    configs = {name: open_folder(TINY / name).config for name in {name for name, _, _ in NULL_CASES}}
    failures, kinds = [], Counter()
    for name, field, derived in NULL_CASES:
        config = derive(configs[name], name, derived)
        kinds[null_expected(config, field)[0]] += 1
        why = null_mismatch(config, name, field)
        if why:
            failures.append(f"{name}{' (layers derived)' if derived else ''} {field}: {why}")
    assert not failures, f"{len(failures)} of {len(NULL_CASES)} nulls:\n" + "\n".join(failures)
    assert len(NULL_CASES) > 1000 and min(kinds[k] for k in ("refused", "default", "none", "ignored")) > 0, kinds


def null_samples() -> list[tuple[str, str, bool, str]]:
    """Per fixture, one null that loads (its default where one matches the checkpoint) and one that is refused,
    rotating through the fields so that the samples cover many of them; a wrapper's refusal is its text model's."""
    cases, samples = defaultdict(list), []
    for name, field, derived in NULL_CASES:
        if not derived:
            cases[name].append(field)
    for i, name in enumerate(sorted(cases)):
        config = json.loads((TINY / name / "config.json").read_text())
        outcomes = {field: null_expected(config, field) for field in cases[name]}
        refusals = [f for f, (kind, _) in outcomes.items() if kind == "refused"] or ["text_config.rms_norm_eps"]
        defaults = [f for f, (kind, value) in outcomes.items() if kind == "default" and config.get(f) == value]
        loads = defaults or [f for f, (kind, _) in outcomes.items() if kind in ("none", "ignored")]
        samples += [
            (name, loads[i % len(loads)], False, "loads"),
            (name, refusals[i % len(refusals)], False, "refused"),
        ]
    return samples + [
        ("gemma3", "sliding_window_pattern", True, "loads"),
        ("qwen2", "max_window_layers", True, "refused"),
    ]


@pytest.mark.slow
@pytest.mark.parametrize("name, field, derived, kind", null_samples(), ids=lambda v: str(v))
def test_a_null_loads_and_runs_or_is_refused_end_to_end(tmp_path, name, field, derived, kind):
    """The sampled copy + load + forward: what the normalizer answers is what load_model does."""

    def change(config: dict) -> None:
        new = edited(derive(config, name, derived), field)
        config.clear()
        config.update(new)

    folder = copy_with_config(tmp_path, name, change)
    expected = null_expected(derive(json.loads((TINY / name / "config.json").read_text()), name, derived), field)
    if kind == "refused":
        error = expected[1] if expected[0] == "refused" else ConfigError  # a wrapper's text_config: refused as its own
        refused(lambda: load_model(folder), error, field.split(".")[-1], "config.json")
        return
    loaded = load_model(folder)
    if expected[0] == "default" and field in loaded.config.args:
        assert loaded.config.args[field] == expected[1], loaded.config.args
    logits = loaded.model(mx.array([[1, 2, 3]]))  # the RoPE base and norm epsilons are used here, not at load
    assert logits.shape == (1, 3, loaded.config.vocab_size) and mx.isfinite(logits).all().item()


def test_gemma3_sliding_window_pattern_null_is_the_default_pattern(tmp_path):
    def change(config: dict) -> None:
        del config["layer_types"]
        config["sliding_window_pattern"] = None  # what transformers writes for a gemma3 config it built

    folder = copy_with_config(tmp_path, "gemma3", change)
    assert load_model(folder).config.layer_types == ("sliding_attention",) * 5 + ("full_attention",)


@pytest.mark.parametrize("value", ["x", 1.5, True, [258, "x"], [[1]], {"id": 1}])
def test_bad_eos_in_generation_config_is_refused(tmp_path, value):
    folder = copy_with_config(tmp_path, "llama_classic", lambda c: None)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": value}))
    refused(lambda: load_model(folder), ConfigError, "eos_token_id", "generation_config.json")


BAD_JSON = [b"\xff\xfe{}", b"{", b"", b"[]", b"5", b"[" * 100_000, b'{"a": ' + b"1" * 5000 + b"}", b"\x00" * 64]


@pytest.mark.parametrize("content", BAD_JSON, ids=lambda b: repr(b[:12]))
@pytest.mark.parametrize("file", ["config.json", "generation_config.json", "model.safetensors.index.json"])
def test_side_file_that_is_not_a_json_object_is_refused(tmp_path, file, content):
    folder = copy_with_config(tmp_path, "llama_classic", lambda c: None)
    (folder / file).write_bytes(content)
    refused(lambda: load_model(folder), ConfigError, file)


def test_oversized_side_file_is_refused_unread(tmp_path):
    folder = copy_with_config(tmp_path, "llama_classic", lambda c: None)
    with open(folder / "config.json", "r+b") as f:
        f.truncate(1 << 30)  # sparse: costs no disk, and must not be read
    refused(lambda: load_model(folder), ConfigError, "config.json", "bytes")


@pytest.mark.parametrize("shard", ["../model.safetensors", "/etc/passwd", "sub/model.safetensors", "", "..", 5, None])
def test_index_pointing_outside_the_folder_is_refused(tmp_path, shard):
    folder = copy_with_config(tmp_path, "llama_classic", lambda c: None)
    index = {"weight_map": {"model.norm.weight": shard, "model.embed_tokens.weight": "model.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    refused(lambda: load_model(folder), CorruptFileError, "model.safetensors.index.json", "model.norm.weight")


def test_one_family_of_number_checks_serves_every_caller():
    from mlxinfer import untrusted
    from mlxinfer.engine import sampling
    from mlxinfer.server import settings

    assert sampling.is_int is untrusted.is_int and sampling.is_finite_number is untrusted.is_finite_number
    assert settings.is_int is untrusted.is_int and settings.is_finite_number is untrusted.is_finite_number
    ints = [0, -3, 2**70, 10**400, np.int64(5), np.uint32(7), np.int8(-1)]
    floats = [0.5, -1e300, np.float32(0.25), np.float64(1e-6)]
    not_numbers = [True, False, np.bool_(True), None, "1", [1], math.nan, math.inf, -math.inf, np.float32("nan")]
    assert all(untrusted.is_int(v) for v in ints) and not any(untrusted.is_int(v) for v in floats + not_numbers)
    assert all(untrusted.is_finite_number(v) for v in ints[:3] + ints[4:] + floats)
    assert not any(untrusted.is_finite_number(v) for v in [10**400, -(10**400), *not_numbers])


# -- memory: refused from the config, then from the tensor index, before building -------------


def small_machine(usable: int, backend: str = "cpu") -> MachineMemory:
    headroom = 1 << 30  # MIN_HEADROOM_BYTES: the total stays small enough for it to apply
    working_set = usable if backend == "metal" else None
    total = headroom + (usable if backend == "cpu" else 4 * usable)
    return MachineMemory(total, total // 2, 0, backend, working_set, None)


@pytest.mark.parametrize("backend", ["cpu", "metal"])
@pytest.mark.parametrize(
    "change",
    [
        {"hidden_size": 2**20, "intermediate_size": 2**22},
        {"vocab_size": 2**31 - 1},
        {"intermediate_size": 2**29},
        {"num_attention_heads": 2**16, "num_key_value_heads": 2**16, "head_dim": 2**12},
    ],
    ids=lambda c: ",".join(c),
)
def test_config_too_large_for_the_machine_is_refused_first(tmp_path, monkeypatch, backend, change):
    monkeypatch.setattr("mlxinfer.models.sizing.machine_memory", lambda: small_machine(8 << 30, backend))
    folder = copy_with_config(tmp_path, "llama_classic", lambda c: c.update(change))
    refused(lambda: load_model(folder), MemoryBudgetError, str(folder), "parameters the config describes", "MiB")


@pytest.mark.parametrize("backend", ["cpu", "metal"])
@pytest.mark.parametrize("name", ["llama_classic", "qwen3", "gemma2"])
def test_weights_too_large_for_the_machine_are_refused_before_building(tmp_path, monkeypatch, name, backend):
    # Enough for the config at 2 bits per weight, not for its float weights.
    monkeypatch.setattr("mlxinfer.models.sizing.machine_memory", lambda: small_machine(200_000, backend))
    folder = copy_with_config(tmp_path, name, lambda c: None)
    refused(lambda: load_model(folder), MemoryBudgetError, str(folder), "its weights need")


def test_a_machine_that_can_hold_the_model_loads_it(monkeypatch):
    monkeypatch.setattr("mlxinfer.models.sizing.machine_memory", lambda: small_machine(4 << 20))
    assert load_model(TINY / "llama_classic").config.num_layers == 2


# -- GGUF metadata ------------------------------------------------------------------------------


def tiny_tensors() -> dict[str, np.ndarray]:
    """The tiny llama as llama.cpp names and orders its tensors."""
    config = json.loads((TINY / "llama_classic" / "config.json").read_text())
    weights = {k: np.array(v) for k, v in mx.load(str(TINY / "llama_classic" / "model.safetensors")).items()}
    out = {}
    for name, value in sorted(weights.items()):
        if ".q_proj." in name:
            value = llama_cpp_permute(value, config["num_attention_heads"])
        elif ".k_proj." in name:
            value = llama_cpp_permute(value, config["num_key_value_heads"])
        out[gguf_name(name)] = value.astype(np.float32)
    return out


TINY_TENSORS = tiny_tensors()


def write_gguf(path: Path, meta: dict[str, tuple[Any, V]] | None = None, tensors: dict | None = None) -> Path:
    """The tiny llama as a GGUF file, with metadata values replaced by `meta` (value, GGUF type)."""
    vocab = json.loads((TINY / "llama_classic" / "tokenizer.json").read_text())["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])] + ["<|endoftext|>", "<|im_start|>"]
    tokens += ["<|im_end|>"] + [f"[UNUSED{i}]" for i in range(272 - len(tokens) - 1)]
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in [
        (writer.add_block_count, 2), (writer.add_context_length, 256), (writer.add_embedding_length, 64),
        (writer.add_feed_forward_length, 128), (writer.add_head_count, 4), (writer.add_head_count_kv, 2),
        (writer.add_rope_freq_base, 10000.0), (writer.add_layer_norm_rms_eps, 1e-6), (writer.add_vocab_size, 272),
        (writer.add_rope_dimension_count, 16), (writer.add_tokenizer_model, "gpt2"), (writer.add_tokenizer_pre, "gpt2"),
        (writer.add_token_list, tokens), (writer.add_token_types, [1] * 256 + [3] * 3 + [5] * 13),
        (writer.add_token_merges, []), (writer.add_bos_token_id, 256), (writer.add_eos_token_id, 258),
        (writer.add_chat_template, "{% for m in messages %}{{ m['content'] }}{% endfor %}"),
    ]:  # fmt: skip
        add(value)
    for key, (value, kind) in (meta or {}).items():
        writer.add_key_value(key, value, kind)
    for name, value in (TINY_TENSORS if tensors is None else tensors).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_tiny_gguf_loads(tmp_path):
    loaded = load_model(write_gguf(tmp_path / "ok.gguf"))
    assert loaded.config.num_layers == 2 and loaded.tokenizer.eos_token_ids == (258,)


WRONG_TYPES = [("12", V.STRING), (1.5, V.FLOAT32), (True, V.BOOL), ([1, 2], V.ARRAY), (["a"], V.ARRAY)]
WRONG_TYPES += [(nested(d), V.ARRAY) for d in (2, MAX_DEPTH, MAX_DEPTH + 1, 64)]
SIZE_KEYS = [
    "llama.embedding_length",
    "llama.feed_forward_length",
    "llama.block_count",
    "llama.attention.head_count",
    "llama.attention.head_count_kv",
    "llama.rope.dimension_count",
    "llama.context_length",
    "llama.vocab_size",
]
BAD_GGUF_SIZES = [(0, V.UINT32), (-1, V.INT32), (-(2**63), V.INT64), (2**31, V.UINT32), (2**63, V.UINT64)]
BAD_GGUF_SIZES += [(2**64 - 1, V.UINT64)]
FLOAT_KEYS = ["llama.attention.layer_norm_rms_epsilon", "llama.rope.freq_base", "llama.rope.scaling.factor"]
BAD_FLOATS = [(0.0, V.FLOAT32), (-1.0, V.FLOAT32), (math.nan, V.FLOAT32), (math.inf, V.FLOAT64), (-math.inf, V.FLOAT32)]
BAD_FLOATS += [(0, V.UINT8), (-5, V.INT64)]
ID_KEYS = ["bos", "eos", "eot", "padding"]
BAD_IDS = [(-1, V.INT32), (272, V.UINT32), (2**40, V.UINT64), (2**63, V.UINT64), (-(2**63), V.INT64)]
STRING_KEYS = [
    "general.architecture",
    "llama.rope.scaling.type",
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.chat_template",
]
WRONG_STRING_TYPES = [(5, V.UINT32), (1.5, V.FLOAT32), (True, V.BOOL), (["llama"], V.ARRAY), (nested(3, "x"), V.ARRAY)]
UNSUPPORTED_STRINGS = [
    ("general.architecture", "mamba"),
    ("llama.rope.scaling.type", "yarn"),
    ("tokenizer.ggml.model", "bert"),
    ("tokenizer.ggml.pre", "made-up"),
]
LIST_CASES = [
    *[("tokenizer.ggml.tokens", v) for v in [("abc", V.STRING), (5, V.UINT32), ([1, 2], V.ARRAY), ([["a"]], V.ARRAY)]],
    *[("tokenizer.ggml.merges", v) for v in [("a b", V.STRING), ([1], V.ARRAY), (["ab"], V.ARRAY)]],
    ("tokenizer.ggml.merges", ([["a b"]], V.ARRAY)),
    *[("tokenizer.ggml.token_type", v) for v in [(1, V.INT32), (["a"] * 272, V.ARRAY), ([1] * 5, V.ARRAY)]],
    *[("tokenizer.ggml.add_bos_token", v) for v in [("yes", V.STRING), (2, V.UINT32), ([True], V.ARRAY)]],
    *[("general.alignment", v) for v in [("32", V.STRING), (0, V.UINT32), (3, V.UINT32), (-32, V.INT32)]],
    *[("general.alignment", v) for v in [(2**40, V.UINT64), (True, V.BOOL), (32.0, V.FLOAT32), (nested(2), V.ARRAY)]],
]
GGUF_CASES = [
    *[(key, value) for key in SIZE_KEYS for value in WRONG_TYPES + BAD_GGUF_SIZES],
    *[(key, value) for key in FLOAT_KEYS for value in WRONG_TYPES[:1] + WRONG_TYPES[2:] + BAD_FLOATS],
    *[(f"tokenizer.ggml.{k}_token_id", value) for k in ID_KEYS for value in WRONG_TYPES],
    *[("tokenizer.ggml.eos_token_id", value) for value in BAD_IDS],  # EOS must stop generation
    *[(key, value) for key in STRING_KEYS for value in WRONG_STRING_TYPES],
    *[(key, (value, V.STRING)) for key, value in UNSUPPORTED_STRINGS],
    *LIST_CASES,
]


@pytest.mark.parametrize("value", BAD_IDS, ids=repr)
def test_gguf_bos_outside_the_vocabulary_is_refused_when_the_model_adds_it(tmp_path, value):
    path = write_gguf(tmp_path / "bos.gguf", {"tokenizer.ggml.bos_token_id": value})
    assert load_model(path).config.bos_token_id is None  # never added: ignored, as llama.cpp does
    path = write_gguf(
        tmp_path / "bos-added.gguf",
        {"tokenizer.ggml.bos_token_id": value, "tokenizer.ggml.add_bos_token": (True, V.BOOL)},
    )
    refused(lambda: load_model(path), MlxInferError, str(path), "tokenizer.ggml.bos_token_id")


@pytest.mark.parametrize("value", BAD_IDS + [(272, V.INT32)], ids=repr)
@pytest.mark.parametrize("key", ["padding", "eot"])
def test_gguf_padding_or_eot_outside_the_vocabulary_is_ignored_with_a_warning(tmp_path, caplog, key, value):
    # Llama-3 fine-tunes ship <|pad|> = 128256, one past the token list; llama.cpp warns and ignores it.
    loaded = load_model(write_gguf(tmp_path / "pad.gguf", {f"tokenizer.ggml.{key}_token_id": value}))
    assert loaded.tokenizer.eos_token_ids == (258,)
    assert f"tokenizer.ggml.{key}_token_id" in caplog.text and "ignored" in caplog.text


@pytest.mark.parametrize("file", ["config.json", "generation_config.json"])
def test_pad_token_id_outside_the_vocabulary_in_config_files_loads(tmp_path, file):
    folder = copy_with_config(tmp_path, "llama_classic", lambda c: None)
    config = json.loads((folder / file).read_text()) if (folder / file).exists() else {}
    config["pad_token_id"] = 272  # one past vocab_size
    (folder / file).write_text(json.dumps(config))
    assert load_model(folder).config.eos_token_ids == (258,)


def gguf_meta(key: str, value: tuple[Any, V]) -> dict[str, tuple[Any, V]]:
    meta = {key: value}
    if key == "llama.rope.scaling.factor":  # read only for linear scaling
        meta["llama.rope.scaling.type"] = ("linear", V.STRING)
    return meta


def gguf_refusal(path: Path, key: str, error: type[MlxInferError] = MlxInferError) -> str | None:
    """Why what load_model runs on a GGUF file's header before it reads a tensor (the parse, gguf_config,
    normalize_config, check_before_build, the tokenizer) does not refuse it with `error` in one line naming `key` and
    the file; None where it does."""
    try:
        with GGUFFile(path) as gguf_file:
            config = normalize_config(gguf_config(gguf_file), source=f"{path} (GGUF metadata)")
            check_before_build(config, gguf_tensors(gguf_file, choose_compute_dtype().size), str(path))
            tokenizer_from_gguf(gguf_file.metadata, f"{path}: GGUF")
    except MlxInferError as e:
        return one_line_naming(e, key, str(path)) if isinstance(e, error) else f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - a crash is a failure of this case, named with it
        return f"{type(e).__name__}, not an MlxInferError: {e}"
    return "accepted"


def test_gguf_metadata_of_the_wrong_type_or_range_is_refused_by_key_on_the_header(tmp_path):
    failures = []
    for key, value in GGUF_CASES:
        path = write_gguf(tmp_path / "bad.gguf", gguf_meta(key, value))
        if why := gguf_refusal(path, key):
            failures.append(f"{key}={value!r:.60}: {why}")
    assert len(GGUF_CASES) > 250 and not failures, "\n".join(failures)


GGUF_END_TO_END = [case for case in GGUF_CASES if len(repr(case[1][0])) > 100]  # nested 64 deep, 272 token types
GGUF_END_TO_END += [("llama.block_count", (2**64 - 1, V.UINT64)), ("tokenizer.ggml.eos_token_id", (2**63, V.UINT64))]
GGUF_END_TO_END += [("general.alignment", (2**40, V.UINT64)), ("general.architecture", ("mamba", V.STRING))]


@pytest.mark.parametrize("key, value", GGUF_END_TO_END, ids=lambda v: repr(v)[:40])
def test_gguf_metadata_of_the_wrong_type_or_range_is_refused_by_key(tmp_path, key, value):
    """End to end, the largest values and one of each other kind: refused within the time and memory bounds."""
    path = write_gguf(tmp_path / "bad.gguf", gguf_meta(key, value))
    refused(lambda: load_model(path), MlxInferError, key, str(path))


NESTED_KEYS = [("llama.block_count", 2), ("tokenizer.chat_template", "x")]


def test_gguf_arrays_nested_to_any_depth_are_refused_on_the_header(tmp_path):
    """Every depth from 1 to 64: past MAX_DEPTH the parse refuses the file; within it, the key's reader refuses."""
    failures = []
    for key, leaf in NESTED_KEYS:
        for depth in range(1, 65):
            path = write_gguf(tmp_path / "nested.gguf", {key: (nested(depth, leaf), V.ARRAY)})
            if why := gguf_refusal(path, key, CorruptFileError if depth > MAX_DEPTH else MlxInferError):
                failures.append(f"{key} nested {depth} deep: {why}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("depth", [MAX_DEPTH, MAX_DEPTH + 1, 64])
@pytest.mark.parametrize("key, leaf", NESTED_KEYS)
def test_gguf_arrays_nested_to_any_depth_are_refused(tmp_path, key, leaf, depth):
    """End to end, on each side of MAX_DEPTH and the deepest."""
    path = write_gguf(tmp_path / "nested.gguf", {key: (nested(depth, leaf), V.ARRAY)})
    error = CorruptFileError if depth > MAX_DEPTH else MlxInferError
    refused(lambda: load_model(path), error, key, str(path))


@pytest.mark.parametrize(
    "key, value, field",
    [
        ("llama.embedding_length", 128, "hidden_size"),
        ("llama.embedding_length", 2**20, "hidden_size"),
        ("llama.feed_forward_length", 256, "intermediate_size"),
        ("llama.block_count", 3, "num_hidden_layers"),
        ("llama.block_count", 10**6, "llama.block_count"),
        ("llama.attention.head_count", 8, "num_attention_heads"),
        ("llama.attention.head_count", 3, "num_attention_heads"),
        ("llama.attention.head_count_kv", 1, "num_key_value_heads"),
        ("llama.attention.head_count_kv", 3, "num_key_value_heads"),
        ("llama.rope.dimension_count", 8, "head_dim"),
        ("llama.rope.dimension_count", 15, "head_dim"),
        ("llama.vocab_size", 1000, "vocab_size"),
    ],
)
def test_gguf_sizes_the_tensors_contradict_are_refused_before_reading_them(tmp_path, key, value, field):
    path = write_gguf(tmp_path / "bad.gguf", {key: (value, V.UINT32)})
    refused(lambda: load_model(path), MlxInferError, field, str(path))


# -- tensor names -------------------------------------------------------------------------------

ODD_NAMES = [
    "",
    ".",
    "..",
    "...weight",
    "a" * 100_000,
    "a\nb",
    "tab\tname",
    "\x00",
    "é.weight",
    "名前.weight",
    "\u202egnp.weight",
    "weight",
    "model.norm.weight ",
    "model..norm.weight",
    "model.layers..mlp.up_proj.weight",
    "model.layers.-1.mlp.up_proj.weight",
    "model.layers.01.mlp.up_proj.weight",
    "model.layers.x.mlp.up_proj.weight",
    "model.layers.2.mlp.up_proj.weight",
    "model.layers.99999999999.mlp.up_proj.weight",
    "model.layers.0.mlp.up_proj.weight.weight",
    "model.embed_tokens.weight.scales",
]


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    header, offset = {}, 0
    for name, value in tensors.items():
        header[name] = {"dtype": "F32", "shape": list(value.shape), "data_offsets": [offset, offset + value.nbytes]}
        offset += value.nbytes
    blob = json.dumps(header).encode()
    data = b"".join(np.ascontiguousarray(v, np.float32).tobytes() for v in tensors.values())
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


@pytest.mark.parametrize("name", ODD_NAMES, ids=lambda n: repr(n)[:30])
def test_odd_tensor_name_in_safetensors_is_one_short_line(tmp_path, name):
    folder = copy_with_config(tmp_path, "llama_classic", lambda c: None)
    weights = {k: np.array(v) for k, v in mx.load(str(folder / "model.safetensors")).items()}
    write_safetensors(folder / "model.safetensors", {**weights, name: np.zeros(4, np.float32)})
    refused(lambda: load_model(folder), WeightMismatchError, str(folder))


HEADER_DEFECTS = [
    {"dtype": "Q9"},
    {"dtype": ["F32"] * 10_000},
    {"shape": [-1]},
    {"shape": [1] * 100_000},
    {"shape": "4"},
    {"data_offsets": [0]},
    {"data_offsets": [4, 0]},
    {"data_offsets": "x" * 100_000},
]


@pytest.mark.parametrize("defect", HEADER_DEFECTS, ids=lambda d: repr(d)[:30])
@pytest.mark.parametrize("name", ["model.norm.weight", "a" * 100_000, "a\nb", ""], ids=lambda n: repr(n)[:12])
def test_crafted_header_entry_is_one_short_line(tmp_path, name, defect):
    folder = copy_with_config(tmp_path, "llama_classic", lambda c: None)
    blob = json.dumps({name: {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], **defect}}).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(4))
    refused(lambda: load_model(folder), CorruptFileError, "model.safetensors")


GGUF_ODD_NAMES = ODD_NAMES + [
    "blk.",
    "blk.0",
    "blk.0.weight",
    "blk..attn_q.weight",
    "blk.x.attn_q.weight",
    "blk.01.attn_q.weight",
    "blk.-1.attn_q.weight",
    "blk.2.attn_q.weight",
    "blk.99999999999.attn_q.weight",
    "blk.0.attn_q",
    "blk.0.attn_q.weight.weight",
    "blk.0.attn_q.scales",  # maps onto q_proj and fails while the file's arrays are in use
    "token_embd",
]


@pytest.mark.parametrize("name", GGUF_ODD_NAMES, ids=lambda n: repr(n)[:30])
def test_odd_tensor_name_in_gguf_is_one_short_line(tmp_path, name):
    path = write_gguf(tmp_path / "odd.gguf", tensors={**TINY_TENSORS, name: np.zeros(4, np.float32)})
    refused(lambda: load_model(path), MlxInferError, str(path))


@pytest.mark.parametrize(
    "extra", ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight"]
)
def test_gguf_names_that_collide_after_mapping_are_refused(tmp_path, extra):
    path = write_gguf(tmp_path / "dup.gguf", tensors={**TINY_TENSORS, extra: np.zeros(4, np.float32)})
    refused(lambda: load_model(path), CorruptFileError, str(path), "both map to", extra)


@pytest.mark.parametrize("extra", ["model.embed_tokens.weight", "model.norm.weight"])
def test_gguf_names_that_collide_are_refused_by_conversion_too(tmp_path, extra):
    from mlxinfer.convert import ConvertSettings, plan_conversion

    path = write_gguf(tmp_path / "dup.gguf", tensors={**TINY_TENSORS, extra: np.zeros(4, np.float32)})
    out = tmp_path / "out"
    refused(lambda: plan_conversion(path, out, ConvertSettings()), CorruptFileError, str(path), "both map to", extra)
    assert not out.exists()


def test_gguf_tensor_named_twice_is_refused(tmp_path):
    path = write_gguf(tmp_path / "twice.gguf")
    data = path.read_bytes()
    path.write_bytes(data.replace(b"blk.0.attn_k.weight", b"blk.0.attn_q.weight", 1))
    refused(lambda: load_model(path), CorruptFileError, str(path), "appears twice")


def test_gguf_metadata_key_written_twice_is_refused(tmp_path):
    path = write_gguf(tmp_path / "twice.gguf")
    data = path.read_bytes()
    path.write_bytes(data.replace(b"tokenizer.ggml.eos_token_id", b"tokenizer.ggml.bos_token_id", 1))
    refused(lambda: load_model(path), CorruptFileError, str(path), "tokenizer.ggml.bos_token_id appears twice")


def test_closing_while_arrays_of_the_file_are_alive_does_not_raise(tmp_path):
    path = write_gguf(tmp_path / "ok.gguf")
    gguf_file = GGUFFile(path)
    view = gguf_file.read("token_embd.weight")
    gguf_file.close()  # the mmap cannot close while `view` exists; that must not hide anything
    assert view.shape == (272, 64)


# -- tokenizer files ----------------------------------------------------------------------------

TOKENIZER_CASES = [
    *[("tokenizer.json", content, TokenizerError, "tokenizer.json") for content in BAD_JSON],
    ("tokenizer.json", b'{"model": 5}', TokenizerError, "tokenizer.json"),
    ("tokenizer.json", b'{"model": {"type": "BPE", "vocab": [1], "merges": []}}', TokenizerError, "tokenizer.json"),
    ("tokenizer.json", b'{"added_tokens": "x"}', TokenizerError, "tokenizer.json"),
    *[("tokenizer_config.json", content, TokenizerError, "tokenizer_config.json") for content in BAD_JSON],
    *[
        ("tokenizer_config.json", json.dumps({field: value}).encode(), TokenizerError, field)
        for field in ("bos_token", "eos_token")
        for value in (5, 1.5, True, ["<s>"], {"content": 5}, {"content": ["x"]})
    ],
    *[
        ("tokenizer_config.json", json.dumps({"chat_template": value}).encode(), ChatTemplateError, "chat_template")
        for value in (
            5,
            True,
            {"default": "x"},
            [5],
            ["x"],
            [{"name": "default", "template": 5}],
            [[{"a": 1}]],
            [{"name": ["default"], "template": "x"}],
            [{"template": "x"}],
        )  # fmt: skip
    ],
    ("chat_template.jinja", b"\xff\xfe{{ x }}", ChatTemplateError, "chat_template.jinja"),
    ("chat_template.jinja", b"ok \xc3", ChatTemplateError, "chat_template.jinja"),
    *[("chat_template.json", content, TokenizerError, "chat_template.json") for content in BAD_JSON],
    ("chat_template.json", b'{"chat_template": 5}', ChatTemplateError, "chat_template.json"),
]


@pytest.mark.parametrize("file, content, error, words", TOKENIZER_CASES, ids=lambda v: repr(v)[:30])
def test_broken_tokenizer_file_is_refused_by_name(tmp_path, file, content, error, words):
    folder = copy_with_config(tmp_path, "llama_classic", lambda c: None)
    if file == "chat_template.json":  # read only when tokenizer_config.json has no template
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config.pop("chat_template")
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / file).write_bytes(content)
    refused(lambda: load_model(folder), error, words, file)


@pytest.mark.parametrize(
    "file, limit, error",
    [
        ("tokenizer.json", MAX_TOKENIZER_BYTES, TokenizerError),
        ("tokenizer_config.json", 64 << 20, TokenizerError),
        ("chat_template.jinja", 64 << 20, ChatTemplateError),
    ],
)
def test_oversized_tokenizer_file_is_refused_unread(tmp_path, file, limit, error):
    folder = copy_with_config(tmp_path, "llama_classic", lambda c: None)
    with open(folder / file, "ab") as f:
        f.truncate(limit + 1)  # sparse
    refused(lambda: load_model(folder), error, file, "bytes")


# -- the command line: one line, non-zero exit, no traceback -------------------------------------


def cli_cases(tmp_path: Path) -> list[Path]:
    layers = copy_with_config(tmp_path, "llama_classic", setter("num_hidden_layers", 10**6))
    tokenizer = copy_with_config(tmp_path, "mistral", lambda c: None)
    (tokenizer / "tokenizer.json").write_bytes(b"\xff\xfe")
    nested_gguf = write_gguf(tmp_path / "nested.gguf", {"llama.block_count": (nested(64), V.ARRAY)})
    odd = write_gguf(tmp_path / "odd.gguf", tensors={**TINY_TENSORS, "blk.0.attn_q.scales": np.zeros(4, np.float32)})
    return [layers, tokenizer, nested_gguf, odd]


def test_the_cli_reports_each_hostile_file_in_one_line(tmp_path):
    for path in cli_cases(tmp_path):
        result = CliRunner().invoke(main, ["generate", str(path), "-p", "x", "--max-tokens", "1"])
        assert result.exit_code == 1, (path, result.output)
        assert not isinstance(result.exception, BufferError) and "Traceback" not in result.output
        errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
        assert len(errors) == 1 and str(path) in errors[0], result.stderr


def test_a_refusal_takes_no_time_even_for_the_largest_layer_count(tmp_path):
    folder = copy_with_config(tmp_path, "llama_classic", setter("num_hidden_layers", 10**6))
    start = time.perf_counter()
    refused(lambda: load_model(folder), ConfigError, "num_hidden_layers")
    assert time.perf_counter() - start < 2.0  # well under 0.1 s even with tracemalloc on; unrefused, minutes


@pytest.mark.slow
def test_a_side_file_that_is_a_device_or_a_pipe_is_one_line(tmp_path):
    """config.json as a link to /dev/zero (it reports 0 bytes and never ends) or as a named pipe with no writer:
    refused at once in one line, not read until memory runs out or waited on (a capped child process)."""
    import os
    import subprocess
    import sys

    def capped() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    for kind in ("device", "pipe"):
        folder = tmp_path / kind
        shutil.copytree(TINY / "llama_classic", folder, ignore=shutil.ignore_patterns("golden.safetensors"))
        (folder / "config.json").unlink()
        if kind == "device":
            (folder / "config.json").symlink_to("/dev/zero")
        else:
            os.mkfifo(folder / "config.json")
        command = [sys.executable, "-c", "from mlxinfer.cli import main; main()", "generate", str(folder), "-p", "a"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=60, preexec_fn=capped)
        assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
        errors = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
        assert errors == [f"Error: {folder / 'config.json'}: not a regular file; a model's side files are plain files"]
        assert result.stderr.strip().endswith(errors[0])  # the last line: nothing after it
