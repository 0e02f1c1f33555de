"""Hostile model files: config.json sizes, GGUF metadata, tensor names, tokenizer files.

Each case is generated (fields x values, keys x wrong types, names x formats) and must
end in one MlxInferError whose one-line message names the file and the field, within
LIMIT_S and LIMIT_BYTES: nothing large is built or read before the input is checked.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
import time
import tracemalloc
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
    WeightMismatchError,
)
from mlxinfer.memory import MachineMemory
from mlxinfer.models.gguf_file import MAX_DEPTH, GGUFFile
from mlxinfer.models.loader import load_model
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


@pytest.mark.parametrize("value", BAD_SIZES, ids=repr)
@pytest.mark.parametrize("field", SIZE_FIELDS)
def test_bad_size_in_config_is_refused_by_name(tmp_path, field, value):
    folder = copy_with_config(tmp_path, "llama_classic", setter(field, value))
    refused(lambda: load_model(folder), ConfigError, field, "config.json")


@pytest.mark.parametrize("name", ["llama_classic", "phi3", "qwen2", "gemma3"])
@pytest.mark.parametrize("field, value", [(f, v) for f, values in WRONG_SIZES.items() for v in values])
def test_size_the_checkpoint_contradicts_is_refused_before_building(tmp_path, name, field, value):
    config = json.loads((TINY / name / "config.json").read_text())
    if field == "head_dim" and "head_dim" not in config:
        pytest.skip("this architecture derives head_dim from hidden_size")

    def change(config: dict) -> None:
        config[field] = value
        if field == "num_hidden_layers" and "layer_types" in config:
            config["layer_types"] = (config["layer_types"] * value)[:value]

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


@pytest.mark.parametrize("name, field, value", OTHER_FIELDS, ids=lambda v: repr(v)[:40])
def test_nonsense_config_value_is_refused_by_name(tmp_path, name, field, value):
    folder = copy_with_config(tmp_path, name, setter(field, value))
    refused(lambda: load_model(folder), MlxInferError, field.split(".")[-1], "config.json")


# Every number config.json gives us, top level and nested: null there means "use the default" where
# transformers has one (num_key_value_heads, sliding_window_pattern, ...), else a ConfigError naming it.
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


@pytest.mark.parametrize("name, field, derived", null_cases())
def test_null_number_in_config_loads_with_the_default_or_is_refused_by_name(tmp_path, name, field, derived):
    def change(config: dict) -> None:
        if derived:
            config.pop("layer_types", None)
            config.update(DERIVED_LAYERS[name])
        setter(field, None)(config)

    folder = copy_with_config(tmp_path, name, change)
    try:
        loaded = load_model(folder)
    except ConfigError as e:
        message = str(e)
        assert field.split(".")[-1] in message and "config.json" in message and "\n" not in message, message
        return
    except MlxInferError as e:  # a null the module cannot run without (gemma2's soft cap) is named too
        assert field.split(".")[-1] in str(e), str(e)
        return
    mx.eval(loaded.model(mx.array([[1, 2, 3]])))  # the RoPE base and norm epsilons are used here, not at load


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


@pytest.mark.parametrize("key, value", GGUF_CASES, ids=lambda v: repr(v)[:40])
def test_gguf_metadata_of_the_wrong_type_or_range_is_refused_by_key(tmp_path, key, value):
    meta = {key: value}
    if key == "llama.rope.scaling.factor":  # read only for linear scaling
        meta["llama.rope.scaling.type"] = ("linear", V.STRING)
    path = write_gguf(tmp_path / "bad.gguf", meta)
    refused(lambda: load_model(path), MlxInferError, key, str(path))


@pytest.mark.parametrize("depth", range(1, 65))
@pytest.mark.parametrize("key, leaf", [("llama.block_count", 2), ("tokenizer.chat_template", "x")])
def test_gguf_arrays_nested_to_any_depth_are_refused(tmp_path, key, leaf, depth):
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
