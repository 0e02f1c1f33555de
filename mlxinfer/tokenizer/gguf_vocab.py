"""Rebuild a fast tokenizer from a GGUF file's `tokenizer.ggml.*` metadata.

GGUF stores the BPE vocabulary, merges and token types; the pre-tokenizer is
only named (`tokenizer.ggml.pre`), so the regexes below restate llama.cpp's
(llama-vocab.cpp) for the names we support. SentencePiece vocabularies
(`tokenizer.ggml.model = llama`) are rebuilt in gguf_spm.py.
"""

from __future__ import annotations

import logging
from typing import Any

from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from ..errors import ChatTemplateError, TokenizerError
from ..untrusted import first_line, is_int, shown
from .gguf_spm import sentencepiece_backend
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

log = logging.getLogger(__name__)


def _pre_tokenizer(name: str, where: str) -> pre_tokenizers.PreTokenizer:
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
        f"{where} metadata tokenizer.ggml.pre={shown(name)} is not supported yet; "
        "use the model's Hugging Face checkpoint"
    )


def _key(metadata: dict[str, Any], key: str, kind: type, where: str) -> Any:
    """`metadata[key]` (None when absent) if it is a `kind`; TokenizerError naming the key otherwise."""
    value = metadata.get(key)
    if value is not None and (not isinstance(value, kind) or isinstance(value, bool) and kind is not bool):
        raise TokenizerError(f"{where} metadata {key!r} must be a {kind.__name__}, got {shown(value)}")
    return value


def _strings(metadata: dict[str, Any], key: str, where: str) -> list[str]:
    values = _key(metadata, key, list, where) or []
    bad = next((v for v in values if not isinstance(v, str)), None)
    if bad is not None:
        raise TokenizerError(f"{where} metadata {key!r} must list strings, got {shown(bad)}")
    return values


def _token_id(metadata: dict[str, Any], key: str, tokens: list[str], where: str, needed: bool = True) -> int | None:
    """A special-token id inside the vocabulary. One outside it is refused when `needed`, else dropped with a
    warning, as llama.cpp does ("bad special token"): fine-tunes ship a <|pad|> id one past the token list."""
    value = _key(metadata, key, int, where)
    if value is not None and not 0 <= value < len(tokens):
        if needed:
            raise TokenizerError(
                f"{where} metadata {key!r} is {shown(value)}, outside the {len(tokens)}-token vocabulary"
            )
        log.warning(
            "%s metadata %r is %s, outside the %d-token vocabulary; ignored", where, key, shown(value), len(tokens)
        )
        return None
    return value


def _bos_id(metadata: dict[str, Any], tokens: list[str], where: str) -> int | None:
    # A model that adds BOS to every prompt computes something else without it: an unusable id is refused then.
    # Otherwise BOS is only the chat template's bos_token, which can do without it.
    return _token_id(metadata, "tokenizer.ggml.bos_token_id", tokens, where, needed=_add_bos(metadata, where))


def _vocabulary(metadata: dict[str, Any], where: str) -> tuple[list[str], list[tuple[str, ...]], list[int]]:
    """Tokens, merges and token types, each checked for type (a crafted file can hold anything)."""
    tokens = _strings(metadata, "tokenizer.ggml.tokens", where)
    if not tokens:
        raise TokenizerError(f"{where} metadata has no tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _strings(metadata, "tokenizer.ggml.merges", where)]
    bad = next((" ".join(m) for m in merges if len(m) != 2), None)
    if bad is not None:
        raise TokenizerError(f"{where} metadata 'tokenizer.ggml.merges' holds {shown(bad)}, not 'a b'")
    types = _key(metadata, "tokenizer.ggml.token_type", list, where) or [1] * len(tokens)
    if len(types) != len(tokens) or not all(is_int(t) for t in types):
        raise TokenizerError(f"{where} metadata 'tokenizer.ggml.token_type' must list one integer per token")
    return tokens, merges, types


def backend_from_gguf(metadata: dict[str, Any], where: str = "GGUF") -> Backend:
    """The fast-tokenizer backend (what tokenizer.json holds) of a GGUF file."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind == "llama":
        backend = sentencepiece_backend(metadata, where)
    elif kind == "gpt2":
        backend = _byte_level_backend(metadata, where)
    else:
        raise TokenizerError(
            f"{where} metadata tokenizer.ggml.model={shown(kind)} is not supported yet "
            "(byte-level BPE 'gpt2' and SentencePiece 'llama'); use the model's Hugging Face checkpoint"
        )
    _, _, types = _vocabulary(metadata, where)
    tokens = _strings(metadata, "tokenizer.ggml.tokens", where)
    # Control and user-defined tokens match whole in the text, as llama.cpp matches them. Only those the vocabulary
    # spells as the file does: an added token it lacks would get an id past the model's embedding (Gemma's runs of
    # spaces, respelled as ▁ pieces, are tokenized by the merges instead, as transformers does).
    kept = [
        (t, k) for t, k in zip(tokens, types) if k in (CONTROL, USER_DEFINED) and backend.token_to_id(t) is not None
    ]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in kept if k == CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in kept if k == USER_DEFINED])
    bos = _bos_id(metadata, tokens, where)
    if _add_bos(metadata, where) and bos is not None:
        # Raw prompts get the BOS token the model was trained with, as llama.cpp adds it.
        backend.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B", special_tokens=[(tokens[bos], bos)]
        )
    return backend


def _byte_level_backend(metadata: dict[str, Any], where: str) -> Backend:
    tokens, merges, types = _vocabulary(metadata, where)
    try:
        backend = Backend(BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    except Exception as e:  # the Rust side raises plain Exception
        reason = first_line(e)
        raise TokenizerError(f"{where} metadata: vocabulary and merges do not form a tokenizer ({reason})") from None
    backend.pre_tokenizer = _pre_tokenizer(_key(metadata, "tokenizer.ggml.pre", str, where) or "default", where)
    backend.decoder = decoders.ByteLevel()
    return backend


def _add_bos(metadata: dict[str, Any], where: str) -> bool:
    value = metadata.get("tokenizer.ggml.add_bos_token")
    if value is None:  # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
        return metadata.get("tokenizer.ggml.model") == "llama"
    if value not in (None, True, False, 0, 1):
        raise TokenizerError(f"{where} metadata 'tokenizer.ggml.add_bos_token' must be a bool")
    return bool(value)


def tokenizer_config_from_gguf(metadata: dict[str, Any], where: str = "GGUF") -> dict[str, Any]:
    """The tokenizer_config.json fields a GGUF file carries: special tokens and chat template."""
    tokens = _strings(metadata, "tokenizer.ggml.tokens", where)
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    # EOS must stop generation: an unusable one is refused. Padding is never needed to generate.
    ids = {
        "bos_token": _bos_id(metadata, tokens, where),
        "eos_token": _token_id(metadata, "tokenizer.ggml.eos_token_id", tokens, where),
        "pad_token": _token_id(metadata, "tokenizer.ggml.padding_token_id", tokens, where, needed=False),
    }
    for name, index in ids.items():
        config[name] = tokens[index] if index is not None else None
    config["add_bos_token"] = _add_bos(metadata, where)
    template = metadata.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise ChatTemplateError(f"{where} metadata 'tokenizer.chat_template' must be a string, got {shown(template)}")
    if template:
        config["chat_template"] = template
    return config


def tokenizer_from_gguf(metadata: dict[str, Any], where: str = "GGUF") -> Tokenizer:
    """Build our Tokenizer from GGUF metadata (byte-level BPE vocabularies); `where` names the file in errors."""
    config = tokenizer_config_from_gguf(metadata, where)
    tokens = _strings(metadata, "tokenizer.ggml.tokens", where)
    # End of generation: EOS, and the end-of-turn token chat models stop on (Llama 3's <|eot_id|>).
    stops = [
        _token_id(metadata, "tokenizer.ggml.eos_token_id", tokens, where),
        _token_id(metadata, "tokenizer.ggml.eot_token_id", tokens, where, needed=False),  # EOS still stops
    ]
    return Tokenizer(
        backend_from_gguf(metadata, where),
        eos_token_ids=[i for i in stops if i is not None],
        bos_token=config["bos_token"],
        eos_token=config["eos_token"],
        chat_template=config.get("chat_template"),
    )
