"""From matchers' allowed tokens to one boolean mask per row, on the device.

llguidance writes allowed tokens as bits (32 tokens a word); the rows of a batch
are computed in parallel by its executor, with the GIL released, while the device
runs the step whose logits they will mask.
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import llguidance.numpy as llg_numpy
import mlx.core as mx
import numpy as np

from .compiled import Constraint

_EXECUTOR: llguidance.LLExecutor | None = None


def allowed_tokens(constraints: Sequence[Constraint | None], size: int) -> mx.array:
    """A (rows, size) boolean array: True where row i's constraint allows the token (every token for None)."""
    bitmask = llg_numpy.allocate_token_bitmask(len(constraints), size)  # all bits set: unconstrained rows
    rows = [(c.matcher, i) for i, c in enumerate(constraints) if c is not None]
    if len(rows) == 1:
        constraints[rows[0][1]].fill_mask(bitmask[rows[0][1]])
    elif rows:
        llg_numpy.fill_next_token_bitmask_par(_executor(), rows, bitmask)
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :size]
    return mx.array(bits.astype(np.bool_))


def draft_masks(constraint: Constraint, drafts: Sequence[int], size: int) -> tuple[int, mx.array]:
    """How many of `drafts` the grammar allows one after another, and its masks before each of those and after the
    last: shape (allowed + 1, size), for verifying them in one pass. The matcher ends where it began."""
    bitmask = llg_numpy.allocate_token_bitmask(len(drafts) + 1, size)
    allowed = 0
    for i, token in enumerate([*drafts, None]):
        constraint.fill_mask(bitmask[i])
        if token is None or not (bitmask[i, token >> 5] >> (token & 31)) & 1:
            break
        constraint.advance(token)
        allowed += 1
    if allowed:
        constraint.rollback(allowed)
    bits = np.unpackbits(bitmask[: allowed + 1].view(np.uint8), axis=1, bitorder="little")[:, :size]
    return allowed, mx.array(bits.astype(np.bool_))


def _executor() -> llguidance.LLExecutor:
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = llguidance.LLExecutor()
    return _EXECUTOR
