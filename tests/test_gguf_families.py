"""GGUF files of each tiny family, written the way llama.cpp's convert_hf_to_gguf.py lays them out.

The tensor names come from the `gguf` package's own map (llama.cpp's tensor_mapping.py), the value
changes (Q/K permutation for llama, 1 + w norms for Gemma 3, gpt-oss's de-interleaved experts) are
restated from the converter, and the logits are compared with transformers' (the fixtures' golden).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest

import mlxinfer
from mlxinfer.errors import ConfigError, UnsupportedModelError, WeightMismatchError
from tests.conftest import TINY, golden

ARCH = {"mistral": "llama", "llama_rope_llama3": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
        "gemma3": "gemma3", "gemma3_long": "gemma3", "gpt_oss": "gpt-oss", "qwen3_moe": "qwen3moe"}  # fmt: skip
_ARCHS = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """LlamaModel.permute: HF rotate-half rows -> interleaved pairs (weights and biases)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(head_dim: int, params: dict) -> np.ndarray:
    """LlamaModel.generate_extra_tensors: one divisor per rotary frequency, in float32 as the converter does."""
    freqs = 1.0 / (params["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old = params["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _tokens(folder: Path) -> list[str]:
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    return [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])] + SPECIALS


def _tensors(fixture: str, arch: str, config: dict) -> dict[str, np.ndarray]:
    """GGUF name -> array, transformed as convert_hf_to_gguf.py does for `arch`."""
    weights = {k: np.array(v) for k, v in mx.load(str(TINY / fixture / "model.safetensors")).items()}
    names = gguf.get_tensor_name_map(_ARCHS[arch], config["num_hidden_layers"])
    out: dict[str, np.ndarray] = {}
    for hf, value in weights.items():
        if arch == "llama" and ".q_proj." in hf:
            value = llama_cpp_permute(value, config["num_attention_heads"])
        elif arch == "llama" and ".k_proj." in hf:
            value = llama_cpp_permute(value, config["num_key_value_heads"])
        if arch == "gemma3" and hf.endswith("norm.weight"):
            value = value + 1  # Gemma3Model.norm_shift
        if arch == "gemma3" and hf == "model.embed_tokens.weight":
            value = value[: len(_tokens(TINY / fixture))]  # the converter drops rows past the tokenizer's vocabulary
        if arch == "gpt-oss" and ".experts." in hf:
            out.update(_gpt_oss_experts(hf, value, names))
            continue
        if arch == "qwen3moe" and ".experts." in hf:
            continue  # stacked below
        name = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        if name is None and arch == "qwen3moe":  # the fixture's dense layer (mlp_only_layers): llama.cpp's names
            name = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, 4).get_name(hf, try_suffixes=(".weight",))
        assert name is not None, hf
        out[name + (".weight" if name.endswith("attn_sinks") else "")] = value
    if arch == "qwen3moe":  # Qwen2MoeModel.modify_tensors: experts.{e}.{w}_proj (out, in) -> (experts, out, in)
        for i in range(config["num_hidden_layers"]):
            for w in ("gate", "up", "down"):
                stack = [weights.get(f"model.layers.{i}.mlp.experts.{e}.{w}_proj.weight") for e in range(4)]
                if stack[0] is not None:
                    out[f"blk.{i}.ffn_{w}_exps.weight"] = np.stack(stack)
    return out


def _gpt_oss_experts(hf: str, value: np.ndarray, names) -> dict[str, np.ndarray]:
    """GptOssModel.modify_tensors: gate_up (E, H, 2I) interleaved -> gate, up (E, I, H); down (E, I, H) -> (E, H, I)."""
    prefix = names.get_name(hf.rsplit(".", 1)[0] + ".gate_proj").rsplit(".", 1)[0]  # blk.N
    leaf = hf.rsplit(".", 1)[1]
    if leaf == "gate_up_proj":
        t = value.swapaxes(1, 2)
        return {f"{prefix}.ffn_gate_exps.weight": t[:, ::2], f"{prefix}.ffn_up_exps.weight": t[:, 1::2]}
    if leaf == "gate_up_proj_bias":
        return {f"{prefix}.ffn_gate_exps.bias": value[..., ::2], f"{prefix}.ffn_up_exps.bias": value[..., 1::2]}
    if leaf == "down_proj":
        return {f"{prefix}.ffn_down_exps.weight": value.swapaxes(1, 2)}
    return {f"{prefix}.ffn_down_exps.bias": value}


def _metadata(w: gguf.GGUFWriter, arch: str, c: dict) -> None:
    """TextModel.set_gguf_parameters and each architecture's additions."""
    rope = c.get("rope_parameters", {})
    rope = rope.get("full_attention", rope)
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    if "head_dim" in c:
        w.add_key_length(c["head_dim"])
        w.add_value_length(c["head_dim"])
    if arch == "llama":
        w.add_rope_dimension_count(c.get("head_dim", c["hidden_size"] // c["num_attention_heads"]))
    if arch == "phi3":
        w.add_rope_dimension_count(int(rope["partial_rotary_factor"] * c["hidden_size"]) // c["num_attention_heads"])
        w.add_rope_scaling_orig_ctx_len(c["original_max_position_embeddings"])
        w.add_sliding_window(c.get("sliding_window") or 0)
    if arch == "gemma3":
        w.add_sliding_window(c["sliding_window"])
    if arch == "qwen3moe":
        w.add_expert_count(c["num_local_experts"])
        w.add_expert_used_count(c["num_experts_per_tok"])
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    if arch == "gpt-oss":
        w.add_expert_count(c["num_local_experts"])
        w.add_expert_used_count(c["num_experts_per_tok"])
        w.add_expert_feed_forward_length(c["intermediate_size"])
        w.add_sliding_window(c["sliding_window"])
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])


def write_family_gguf(
    path: Path, fixture: str, types: dict[str, gguf.GGMLQuantizationType] | None = None, edit=None
) -> Path:
    """The tiny `fixture` as a GGUF file; `types` quantizes the named GGUF tensors with the gguf package,
    `edit(metadata, tensors)` changes the key/value dict and the tensors before they are written."""
    arch, folder = ARCH[fixture], TINY / fixture
    config = json.loads((folder / "config.json").read_text())
    tokens = _tokens(folder)
    writer = gguf.GGUFWriter(str(path), arch)
    _metadata(writer, arch, config)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "gpt2")
    if arch != "gemma3":  # padded to the model's vocabulary, as llama.cpp's _set_vocab_gpt2 does
        tokens += [f"[PAD{i}]" for i in range(config["vocab_size"] - len(tokens))]
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3, 3, 3] + [5] * (len(tokens) - 259))
    writer.add_token_merges([])
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(258)
    writer.add_chat_template(json.loads((folder / "tokenizer_config.json").read_text())["chat_template"])
    tensors = _tensors(fixture, arch, config)
    if arch == "llama" and config.get("rope_parameters", {}).get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = llama3_rope_factors(config["head_dim"], config["rope_parameters"])
    if edit is not None:
        edit(writer.kv_data[0], tensors)
    for name, value in tensors.items():
        kind = (types or {}).get(name)
        if kind is None:
            writer.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))
        else:
            packed = gguf.quants.quantize(np.ascontiguousarray(value, dtype=np.float32), kind)
            writer.add_tensor(name, packed, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


FIXTURES = ["mistral", "qwen2", "qwen3", "phi3", "gemma3", "gemma3_long", "gpt_oss", "llama_rope_llama3", "qwen3_moe"]


@pytest.mark.parametrize("fixture", FIXTURES)
def test_gguf_family_matches_transformers(tmp_path, fixture):
    ref = golden(fixture)
    model = mlxinfer.load(write_family_gguf(tmp_path / f"{fixture}.gguf", fixture), dtype="float32")
    logits = np.array(model.logits(ref["input_ids"].tolist()))
    expected = np.array(ref["logits"])[:, : logits.shape[-1]]  # Gemma's GGUF drops the unused rows
    assert logits.shape[-1] >= 259
    assert np.abs(logits - expected).max() < 1e-3
    assert model.generate(ref["input_ids"].tolist(), max_tokens=16).token_ids == ref["greedy"].tolist()
    # The chat template travels in the GGUF: ChatML's <|im_start|> opens the prompt.
    assert model.tokenizer.encode_chat([{"role": "user", "content": "hi"}])[0] == 257


def _one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    def rename(kv, tensors):
        kv["general.architecture"] = gguf.GGUFValue("mamba", gguf.GGUFValueType.STRING)

    with pytest.raises(UnsupportedModelError) as e:
        mlxinfer.load(write_family_gguf(tmp_path / "m.gguf", "qwen2", edit=rename))
    assert "general.architecture='mamba'" in _one_line(e)
    assert "gemma3, gpt-oss, llama, phi3, qwen2, qwen3" in _one_line(e)


def test_missing_metadata_key_is_named(tmp_path):
    with pytest.raises(ConfigError, match="lacks 'qwen3.block_count'") as e:
        mlxinfer.load(write_family_gguf(tmp_path / "m.gguf", "qwen3", edit=lambda kv, t: kv.pop("qwen3.block_count")))
    _one_line(e)


def test_tensor_shape_that_disagrees_with_the_metadata_is_named(tmp_path):
    def wider(kv, tensors):  # the metadata says 96 hidden units, the tensors hold 64
        kv["qwen2.embedding_length"] = gguf.GGUFValue(96, gguf.GGUFValueType.UINT32)

    with pytest.raises((WeightMismatchError, ConfigError)) as e:
        mlxinfer.load(write_family_gguf(tmp_path / "m.gguf", "qwen2", edit=wider))
    assert "model.embed_tokens.weight" in _one_line(e) or "embed" in _one_line(e)


def test_unknown_ggml_type_names_the_type_and_tensor(tmp_path):
    path = write_family_gguf(tmp_path / "m.gguf", "qwen2")
    data = bytearray(path.read_bytes())
    name = b"blk.1.ffn_down.weight"
    at = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)
    dims = int.from_bytes(data[at : at + 4], "little")
    type_at = at + 4 + 8 * dims
    data[type_at : type_at + 4] = (99).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(UnsupportedModelError, match="blk.1.ffn_down.weight.*GGML type 99") as e:
        mlxinfer.load(path)
    _one_line(e)


def test_gpt_oss_mxfp4_experts_compute_their_dequantized_values(tmp_path, caplog):
    mxfp4 = gguf.GGMLQuantizationType.MXFP4
    types = {f"blk.{i}.ffn_{w}_exps.weight": mxfp4 for i in range(4) for w in ("gate", "up")}
    path = write_family_gguf(tmp_path / "oss.gguf", "gpt_oss", types=types)
    with caplog.at_level("INFO"):
        model = mlxinfer.load(path, dtype="float32")
    assert any("MXFP4" in r.getMessage() for r in caplog.records)
    reader = gguf.GGUFReader(str(path))
    stored = next(t for t in reader.tensors if t.name == "blk.2.ffn_up_exps.weight")
    expected = gguf.quants.dequantize(stored.data, mxfp4).reshape(4, 24, 64)  # the gguf package's MXFP4 reading
    up = model._loaded.model.layers[2].mlp.experts.up_proj  # kept as MLX mxfp4 (tests/test_mxfp4.py)
    got = mx.dequantize(up.weight, up.scales, None, group_size=32, bits=4, mode="mxfp4", dtype=mx.float32)
    assert np.array_equal(np.array(got), expected)
    ref = golden("gpt_oss")
    logits = np.array(model.logits(ref["input_ids"].tolist()))
    # 4-bit experts on random weights: not exact, but the same function (the F32 file matches exactly, above).
    assert np.corrcoef(logits.ravel(), np.array(ref["logits"]).ravel())[0, 1] > 0.9


def _random_k_blocks(kind: gguf.GGMLQuantizationType, rows: int, cols: int) -> np.ndarray:
    """Valid K-quant bytes: random quants and sub-scales, small positive f16 super-block scales."""
    per, size = gguf.GGML_QUANT_SIZES[kind]
    blocks = np.random.default_rng(int(kind)).integers(0, 256, size=(rows * cols // per, size), dtype=np.uint8)
    small = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
    if kind == gguf.GGMLQuantizationType.Q6_K:
        blocks[:, size - 2 :] = small  # d is last
    else:
        blocks[:, 0:2] = small
        blocks[:, 2:4] = np.frombuffer(np.float16(0.001).tobytes(), np.uint8)  # dmin (Q2_K..Q5_K)
    return blocks.reshape(rows, cols // per * size)


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q5_0", "Q5_1"])
def test_k_quant_tensors_load_as_their_dequantized_values(tmp_path, kind):
    """Q4_K_M files mix Q4_K, Q5_K or Q5_0, Q6_K and Q8_0; each reads as the gguf package dequantizes it."""
    from tests.test_gguf import write_tiny_gguf

    qtype = gguf.GGMLQuantizationType[kind]
    name = "model.layers.0.mlp.down_proj.weight"  # (256, 512): rows of whole 256-value blocks
    path = write_tiny_gguf(tmp_path / "kq.gguf", k_quant=name, hidden=256, k_type=qtype)
    reader = gguf.GGUFReader(str(path))
    stored = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    expected = gguf.quants.dequantize(stored.data, qtype).reshape(256, 512)
    layer = mlxinfer.load(path, dtype="float32")._loaded.model.model.layers[0].mlp.down_proj
    grid = {"Q4_K": 4, "Q5_K": 5, "Q6_K": 6, "Q8_0": 8, "Q5_0": 5, "Q5_1": 5}[kind]
    assert (layer.bits, layer.group_size) == (grid, 32)  # every type stays quantized
    # Legacy blocks' float16 scales are held as stored (half the bytes); K-quant products d*sc need float32.
    assert (
        layer.scales.dtype
        == layer.biases.dtype
        == (mx.float16 if kind.endswith("_0") or kind.endswith("_1") else mx.float32)
    )
    scales, biases = (a.astype(mx.float32) for a in (layer.scales, layer.biases))  # widened, as quantized_matmul does
    got = np.array(mx.dequantize(layer.weight, scales, biases, group_size=32, bits=layer.bits))
    if kind != "Q6_K":  # repacked: the file's own codes
        assert np.allclose(got, expected, rtol=1e-3, atol=1e-6)
    else:  # 16-value sub-blocks: rounded once onto 6-bit groups of 32, each value within half a step
        half_step = np.repeat(np.array(layer.scales), 32, axis=1) / 2
        assert np.all(np.abs(got - expected) <= half_step * (1 + 1e-5) + 1e-7)


def test_float16_scales_are_held_as_stored_and_compute_what_float32_weights_do(tmp_path):
    """Under float32 compute, Q8_0's float16 scales stay float16 (the model holds ~1.06x its file, not 1.18x);
    every product and every looked-up row still equals the float32 dequantized weights'."""
    from mlxinfer.formats.gguf_file import GGUFFile
    from mlxinfer.models.gguf import gguf_tensors
    from tests.test_gguf import write_tiny_gguf

    names = ["model.embed_tokens.weight"] + [
        f"model.layers.{i}.{m}.weight"
        for i in range(2)
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.down_proj")
    ]
    path = write_tiny_gguf(tmp_path / "q8.gguf", k_quants=dict.fromkeys(names, gguf.GGMLQuantizationType.Q8_0))
    held = mlxinfer.load(path, dtype="float32", cpu_weights="quantized")._loaded
    dense = mlxinfer.load(path, dtype="float32", cpu_weights="dense")._loaded
    embed = held.model.model.embed_tokens
    assert embed.scales.dtype == embed.biases.dtype == mx.float16
    ids = mx.array([[3, 17, 256, 101, 5]])
    rows = embed(ids)
    assert rows.dtype == mx.float32
    assert mx.array_equal(rows, dense.model.model.embed_tokens(ids))  # widened before dequantizing, not rounded
    np.testing.assert_allclose(np.array(held.model(ids)), np.array(dense.model(ids)), rtol=1e-4, atol=1e-5)
    with GGUFFile(path) as f:  # the planner counts what is held
        forecast = sum(t.loaded_bytes for t in gguf_tensors(f, compute_size=4).values())
    assert forecast == held.weights_bytes


def test_rope_freqs_that_no_llama3_setting_gives_is_refused(tmp_path):
    def scramble(kv, tensors):
        tensors["rope_freqs.weight"] = tensors["rope_freqs.weight"][::-1].copy()  # rising, then falling: no band

    with pytest.raises(UnsupportedModelError, match="rope_freqs.weight is not a llama3 RoPE scaling") as e:
        mlxinfer.load(write_family_gguf(tmp_path / "r.gguf", "llama_rope_llama3", edit=scramble))
    _one_line(e)
