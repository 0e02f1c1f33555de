"""Rebuild a fast tokenizer from a GGUF file's `tokenizer.ggml.*` metadata.

GGUF stores the BPE vocabulary, merges and token types; the pre-tokenizer is
only named (`tokenizer.ggml.pre`), so the regexes below restate llama.cpp's
(llama-vocab.cpp) for the names we support.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from ..errors import TokenizerError
from .tokenizer import Tokenizer

# llama-bpe and qwen2 differ only in how many digits a number chunk may hold.
_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}DIGITS"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3 = _SPLIT.replace("DIGITS", "{1,3}")
_QWEN2 = _SPLIT.replace("DIGITS", "")
# Pre-tokenizers that split single digits, then apply GPT-2's byte-level regex.
_DIGIT_SPLITTING = {"smollm", "starcoder", "refact", "codeshell"}
CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types


def _pre_tokenizer(name: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name in ("gpt2", "default"):
        return byte_level
    if name in _DIGIT_SPLITTING:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if name in ("llama-bpe", "llama3", "qwen2"):
        regex = _QWEN2 if name == "qwen2" else _LLAMA3
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise TokenizerError(
        f"GGUF tokenizer.ggml.pre={name!r} is not supported yet; use the model's Hugging Face checkpoint"
    )


def _as_int(value: Any) -> int | None:
    if value is None:
        return None
    return int(value.item() if hasattr(value, "item") else value)


def backend_from_gguf(metadata: dict[str, Any]) -> Backend:
    """The fast-tokenizer backend (what tokenizer.json holds) of a GGUF file."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise TokenizerError(
            f"GGUF tokenizer.ggml.model={kind!r} is not supported yet (only byte-level BPE, 'gpt2'); "
            "use the model's Hugging Face checkpoint"
        )
    tokens: list[str] = list(metadata.get("tokenizer.ggml.tokens") or [])
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges") or []]
    if not tokens:
        raise TokenizerError("GGUF metadata has no tokenizer.ggml.tokens")
    types = [int(t) for t in metadata.get("tokenizer.ggml.token_type", [])] or [1] * len(tokens)
    backend = Backend(BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = _pre_tokenizer(str(metadata.get("tokenizer.ggml.pre", "default")))
    backend.decoder = decoders.ByteLevel()
    specials = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == CONTROL]
    backend.add_special_tokens(specials)
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED]
    backend.add_tokens(user)
    bos = _as_int(metadata.get("tokenizer.ggml.bos_token_id"))
    if _as_int(metadata.get("tokenizer.ggml.add_bos_token")) and bos is not None and 0 <= bos < len(tokens):
        # Raw prompts get the BOS token the model was trained with, as llama.cpp adds it.
        backend.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B", special_tokens=[(tokens[bos], bos)]
        )
    return backend


def tokenizer_config_from_gguf(metadata: dict[str, Any]) -> dict[str, Any]:
    """The tokenizer_config.json fields a GGUF file carries: special tokens and chat template."""
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    for key in ("bos", "eos", "padding"):
        index = _as_int(metadata.get(f"tokenizer.ggml.{key}_token_id"))
        name = "pad_token" if key == "padding" else f"{key}_token"
        config[name] = tokens[index] if index is not None and 0 <= index < len(tokens) else None
    config["add_bos_token"] = bool(_as_int(metadata.get("tokenizer.ggml.add_bos_token")) or False)
    if metadata.get("tokenizer.chat_template"):
        config["chat_template"] = metadata["tokenizer.chat_template"]
    return config


def tokenizer_from_gguf(metadata: dict[str, Any]) -> Tokenizer:
    """Build our Tokenizer from GGUF metadata (byte-level BPE vocabularies)."""
    config = tokenizer_config_from_gguf(metadata)
    # End of generation: EOS, and the end-of-turn token chat models stop on (Llama 3's <|eot_id|>).
    stops = [_as_int(metadata.get(f"tokenizer.ggml.{k}_token_id")) for k in ("eos", "eot")]
    return Tokenizer(
        backend_from_gguf(metadata),
        eos_token_ids=[i for i in stops if i is not None],
        bos_token=config["bos_token"],
        eos_token=config["eos_token"],
        chat_template=config.get("chat_template"),
    )
