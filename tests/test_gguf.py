"""GGUF files written here with the `gguf` package: names, Q/K permutation, F32/Q8_0/K-quant tensors.

The tiny llama checkpoint is written the way llama.cpp's converter writes it (its tensor
names, Q and K rows permuted), so loading it must reproduce transformers' logits exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from mlxinfer.convert import convert

import mlxinfer
from mlxinfer.errors import CorruptFileError
from mlxinfer.formats.gguf_file import GGUFFile, read_metadata
from tests.conftest import TINY, golden

NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `permute`: HF rotate-half rows -> interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str:
    if hf.startswith("model.layers."):
        _, _, index, rest = hf.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        return f"blk.{index}.{NAMES[module]}.{kind}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}[hf]


def random_q4_k_blocks(rows: int, cols: int, seed: int = 0, kind=gguf.GGMLQuantizationType.Q4_K) -> np.ndarray:
    if kind != gguf.GGMLQuantizationType.Q4_K:
        from tests.test_gguf_families import _random_k_blocks

        return _random_k_blocks(kind, rows, cols)
    """Valid Q4_K bytes: small positive f16 scale d and min dmin, random 6-bit sub-scales and nibbles."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // 256, 144), dtype=np.uint8)
    blocks[:, 0:2] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
    blocks[:, 2:4] = np.frombuffer(np.float16(0.001).tobytes(), np.uint8)
    return blocks.reshape(rows, cols // 256 * 144)


def write_tiny_gguf(
    path: Path,
    k_quant: str | None = None,
    hidden: int | None = None,
    k_type=gguf.GGMLQuantizationType.Q4_K,
    k_quants: dict | None = None,
    floats: dict[str, np.ndarray] | None = None,
    file_type: int | None = None,
    sampling: dict[str, float] | None = None,
) -> Path:
    """The tiny llama fixture as GGUF; with `hidden`, random weights of that width instead. `k_quant` is stored as
    `k_type` (random K blocks, or Q8_0 of its value), `k_quants` maps more names to their types; `floats` gives
    tensors (HF names, already in llama.cpp's row order) stored as F32 instead; `sampling` ({"temp": 0.7, ...})
    is written by the gguf writer's own add_sampling_* methods."""
    kinds = {**(k_quants or {}), **({k_quant: k_type} if k_quant else {})}
    folder = TINY / "llama_classic"
    config = json.loads((folder / "config.json").read_text())
    weights = {k: np.array(v) for k, v in mx.load(str(folder / "model.safetensors")).items()}
    if hidden:
        config.update(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1)
        weights = _random_llama(config)
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])] + specials
    tokens += [f"[UNUSED{i}]" for i in range(config["vocab_size"] - len(tokens))]
    writer = gguf.GGUFWriter(str(path), "llama")
    if file_type is not None:  # general.file_type, llama.cpp's LlamaFileType
        writer.add_file_type(file_type)
    for key, value in (sampling or {}).items():
        getattr(writer, f"add_sampling_{key}")(value)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(config["hidden_size"] // config["num_attention_heads"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3, 3, 3] + [5] * (len(tokens) - 259))
    writer.add_token_merges([])
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(258)
    writer.add_chat_template(json.loads((folder / "tokenizer_config.json").read_text())["chat_template"])
    for name, value in sorted(weights.items()):
        if ".q_proj." in name:
            value = llama_cpp_permute(value, config["num_attention_heads"])
        elif ".k_proj." in name:
            value = llama_cpp_permute(value, config["num_key_value_heads"])
        if floats and name in floats:
            writer.add_tensor(gguf_name(name), floats[name].astype(np.float32))
        elif name in kinds:
            blocks = (
                gguf.quants.quantize(value.astype(np.float32), kinds[name])
                if kinds[name] == gguf.GGMLQuantizationType.Q8_0
                else random_q4_k_blocks(*value.shape, kind=kinds[name])
            )
            writer.add_tensor(gguf_name(name), blocks, raw_dtype=kinds[name])
        else:
            writer.add_tensor(gguf_name(name), value.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _random_llama(config: dict) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    h, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = h // config["num_attention_heads"] * config["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    layer = {"input_layernorm": (h,), "post_attention_layernorm": (h,), "self_attn.q_proj": (h, h),
             "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h), "self_attn.o_proj": (h, h),
             "mlp.gate_proj": (f, h), "mlp.up_proj": (f, h), "mlp.down_proj": (h, f)}  # fmt: skip
    shapes.update({f"model.layers.0.{k}.weight": s for k, s in layer.items()})
    return {k: (rng.standard_normal(s) * 0.05).astype(np.float32) for k, s in shapes.items()}


def test_gguf_written_like_llama_cpp_matches_transformers(tmp_path):
    ref = golden("llama_classic")
    model = mlxinfer.load(write_tiny_gguf(tmp_path / "tiny.gguf"))
    logits = model.logits(ref["input_ids"].tolist())
    assert np.abs(logits - np.array(ref["logits"])).max() < 1e-3
    assert model.generate(ref["input_ids"].tolist(), max_tokens=16).token_ids == ref["greedy"].tolist()
    assert model.tokenizer.encode_chat([{"role": "user", "content": "hi"}])[0] == 257


def test_k_quant_tensors_are_dequantized_then_requantized(tmp_path):
    """Converting Q4_K to 8 bits rounds afresh from its exact values (kept Q4_K is in test_gguf_kquants.py)."""
    name = "model.layers.0.mlp.down_proj.weight"  # (256, 512): rows of whole 256-value K blocks
    path = write_tiny_gguf(tmp_path / "kq.gguf", k_quant=name, hidden=256)
    stored = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "blk.0.ffn_down.weight")
    expected = gguf.quants.dequantize(stored.data, gguf.GGMLQuantizationType.Q4_K).reshape(256, 512)
    assert np.isfinite(expected).all()
    out = tmp_path / "kq-8bit"
    convert(path, out, bits=8, group_size=32, evaluate=False, progress=False)
    layer = mlxinfer.load(out, dtype="float32")._loaded.model.model.layers[0].mlp.down_proj
    got = mx.dequantize(layer.weight, layer.scales, layer.biases, group_size=32, bits=8)
    scale = np.abs(expected).max()
    assert np.abs(np.array(got) - expected).max() < scale / 100  # 8-bit error, not a wrong layout


@pytest.mark.parametrize("field, value, words", [("tokenizer.ggml.model", "bert", "not supported")])
def test_unsupported_gguf_tokenizer_is_one_clear_error(tmp_path, field, value, words):
    from mlxinfer.errors import TokenizerError
    from mlxinfer.tokenizer.gguf_vocab import tokenizer_from_gguf

    with GGUFFile(write_tiny_gguf(tmp_path / "t.gguf")) as f:
        metadata = {**f.metadata, field: value}
    with pytest.raises(TokenizerError, match=words):
        tokenizer_from_gguf(metadata)


def test_metadata_only_reads_step_over_the_vocabulary_and_never_reach_the_tensors(tmp_path):
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list([f"tok{i}" for i in range(1000)])
    writer.add_chat_template("{{ template }}")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    wanted = {"general.architecture", "tokenizer.ggml.tokens", "tokenizer.chat_template"}
    expected = {"general.architecture": "llama", "tokenizer.chat_template": "{{ template }}"}  # arrays stay unread
    assert read_metadata(path, wanted) == expected
    assert read_metadata(path, wanted, max_skipped_items=999) == {"general.architecture": "llama"}  # stops before
    assert read_metadata(path, wanted, max_value_bytes=4) == {}  # longer strings are stepped over
    data = path.read_bytes()
    path.write_bytes(data[: data.index(b"{{ template }}") + 14])  # cut before the tensor table
    assert read_metadata(path, wanted) == expected
    with pytest.raises(CorruptFileError, match="ends inside its header"):
        GGUFFile(path)
    path.write_bytes(data[: data.index(b"tok500")])
    with pytest.raises(CorruptFileError, match="ends inside its header"):
        read_metadata(path, wanted)


def spm_metadata(arch: str) -> dict:
    """A small SentencePiece vocabulary as llama.cpp stores it: <unk>/<s>/</s>, 256 <0xNN> byte pieces, pieces."""
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "llo", "▁h", "▁he", "▁hello", "wo", "▁w",
              "▁wor", "ld", "▁world", "▁▁", "é", "  "]  # fmt: skip
    user = ["   ", "<mask>"]  # user-defined: Gemma's files mark runs of spaces so, beside tokens like <mask>
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces, *user, "<start_of_turn>"]
    scores = [0.0, 0.0, 0.0, *([0.0] * 256), *(-float(i) for i in range(len(pieces) + len(user))), 0.0]
    types = [2, 3, 3, *([6] * 256), *([1] * len(pieces)), *([4] * len(user)), 3]
    return {"general.architecture": arch, "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0}  # fmt: skip


@pytest.mark.parametrize("arch", ["llama", "gemma3", "phi3"])
def test_sentencepiece_gguf_vocabulary_tokenizes_like_transformers(arch):
    pytest.importorskip("transformers")
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    from mlxinfer.tokenizer.gguf_vocab import backend_from_gguf

    md = spm_metadata(arch)
    keys = {"tokens": "tokens", "scores": "scores", "token_type": "token_type", "bos_token_id": "bos_token_id",
            "eos_token_id": "eos_token_id", "unknown_token_id": "unk_token_id"}  # fmt: skip
    ref_dict = {new: md[f"tokenizer.ggml.{old}"] for old, new in keys.items()} | {"tokenizer_type": "llama"}
    reference, _ = convert_gguf_tokenizer(arch, ref_dict)
    ours = backend_from_gguf(md)
    texts = ["hello world", " hello  world", "hello\nwörld ✓", "<start_of_turn>hello", "hé llo", "wor ld  "]
    texts += ["a   b    c      d", "x<mask>y"]  # runs of spaces, a user-defined token
    assert max(ours.get_vocab().values()) < len(md["tokenizer.ggml.tokens"])  # no id past the embedding
    for text in texts:
        expected = reference.encode(text, add_special_tokens=False).ids
        got = ours.encode(text, add_special_tokens=False).ids
        assert got == expected, text
        assert ours.decode(got, skip_special_tokens=False) == reference.decode(expected, skip_special_tokens=False)
    # Byte fallback really happened: '✓' is not a piece, its three UTF-8 bytes are.
    assert [f"<0x{b:02X}>" for b in "✓".encode()] == [md["tokenizer.ggml.tokens"][i] for i in ours.encode("✓").ids[-3:]]
    # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise.
    assert ours.encode("hello").ids[0] == 1
