"""Whether two models' tokenizers give every text the same ids (a draft model must share the target's)."""

from __future__ import annotations

from ..errors import DraftModelError
from .tokenizer import Tokenizer


def check_same_vocabulary(target: Tokenizer, draft: Tokenizer, target_name: str, draft_name: str) -> None:
    """A DraftModelError naming both models unless `draft` maps every token to the id `target` does."""
    ours, theirs = target.backend.get_vocab(with_added_tokens=True), draft.backend.get_vocab(with_added_tokens=True)
    if ours == theirs:
        return
    differing = sorted((t for t in ours.keys() ^ theirs.keys()), key=str)[:3]
    if not differing:
        differing = sorted((t for t in ours if ours[t] != theirs[t]), key=str)[:3]
    raise DraftModelError(
        f"{draft_name}: its tokenizer differs from {target_name}'s ({len(theirs)} tokens against {len(ours)}; "
        f"e.g. {', '.join(repr(t) for t in differing)}); a draft model must share the target's tokenizer "
        "(pick a smaller model of the same family)"
    )
