"""Rebuild a fast tokenizer from a GGUF file's `tokenizer.ggml.*` metadata.

GGUF stores the BPE vocabulary, merges and token types; the pre-tokenizer is
only named (`tokenizer.ggml.pre`), so the regexes below restate llama.cpp's
(llama-vocab.cpp) for the names we support.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, decoders, pre_tokenizers
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


def tokenizer_from_gguf(metadata: dict[str, Any]) -> Tokenizer:
    """Build our Tokenizer from GGUF metadata (byte-level BPE vocabularies)."""
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
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == CONTROL]
    )
    backend.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED]
    )
    bos, eos = (_as_int(metadata.get(f"tokenizer.ggml.{k}_token_id")) for k in ("bos", "eos"))
    return Tokenizer(
        backend,
        eos_token_ids=[eos] if eos is not None else [],
        bos_token=tokens[bos] if bos is not None and bos < len(tokens) else None,
        eos_token=tokens[eos] if eos is not None and eos < len(tokens) else None,
        chat_template=metadata.get("tokenizer.chat_template"),
    )
