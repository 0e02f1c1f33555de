"""A SentencePiece vocabulary from GGUF metadata (`tokenizer.ggml.model = llama`) as a fast tokenizer.

llama.cpp's SPM tokenizer merges the adjacent pair whose joined piece scores highest, falling back to
<0xNN> byte tokens; that is BPE with merges ranked by score and byte_fallback, which is how transformers
rebuilds it (integrations/gguf/gguf_tokenizer_mapping.py: LlamaTokenizer / GemmaTokenizer, merges from
`generate_merges`). Gemma's files list pieces in merge order and keep runs of spaces as real spaces.
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer as Backend
from tokenizers import decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from ..errors import TokenizerError
from ..untrusted import first_line, is_finite_number, is_int, shown

SPACE = "\u2581"  # SentencePiece's visible space


def sentencepiece_backend(metadata: dict[str, Any], where: str) -> Backend:
    """BPE with byte fallback over the file's pieces; pre-tokenizer and decoder as the architecture's
    reference tokenizer has them (Gemma: spaces -> ▁, no prefix; Phi-3: normalizer prefix; else Metaspace)."""
    tokens = _pieces(metadata, where)
    arch = metadata.get("general.architecture")
    gemma = isinstance(arch, str) and arch.startswith("gemma")
    if gemma:  # a piece of spaces is stored as spaces; the tokenizer looks for ▁▁
        tokens = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        ranks = {t: -i for i, t in enumerate(tokens)}  # Gemma's merge order is its piece order, not its scores
    else:
        ranks = dict(zip(tokens, _scores(metadata, len(tokens), where)))
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = metadata.get("tokenizer.ggml.unknown_token_id")
    unk_token = tokens[unk] if is_int(unk) and 0 <= unk < len(tokens) else None
    try:
        backend = Backend(
            BPE(vocab=vocab, merges=merges_from_scores(vocab, ranks), unk_token=unk_token, fuse_unk=True,
                byte_fallback=True)
        )  # fmt: skip
    except Exception as e:  # the Rust side raises plain Exception
        reason = first_line(e)
        raise TokenizerError(f"{where} metadata: the SentencePiece pieces do not form a tokenizer ({reason})") from None
    pieces = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        backend.normalizer = normalizers.Replace(" ", SPACE)
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    elif arch == "phi3":
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
        pieces.append(decoders.Strip(content=" ", left=1))
    else:
        prefix = metadata.get("tokenizer.ggml.add_space_prefix", True) is not False
        backend.pre_tokenizer = pre_tokenizers.Metaspace(SPACE, "first" if prefix else "never", split=False)
        if prefix:
            pieces.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(pieces)
    return backend


def merges_from_scores(vocab: dict[str, int], ranks: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces, best-scoring joined piece first (transformers' generate_merges)."""
    merges: list[tuple[str, str, float]] = []
    for piece, rank in ranks.items():
        local = [
            (piece[:i], piece[i:], rank) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab
        ]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _pieces(metadata: dict[str, Any], where: str) -> list[str]:
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise TokenizerError(f"{where} metadata 'tokenizer.ggml.tokens' must be a non-empty list of strings")
    return tokens


def _scores(metadata: dict[str, Any], count: int, where: str) -> list[float]:
    scores = metadata.get("tokenizer.ggml.scores")
    if not isinstance(scores, list) or len(scores) != count or not all(is_finite_number(x) for x in scores):
        raise TokenizerError(
            f"{where} metadata 'tokenizer.ggml.scores' must list one finite number per token "
            f"(a SentencePiece vocabulary ranks its pieces by them), got {shown(scores)}"
        )
    return [float(x) for x in scores]
