"""Spend bits where they hurt most, measured on calibration text.

Layers are grouped by role (the output head, each attention and MLP projection).
For each group we quantize just that group to 4 bits, leave the rest in float,
and measure the KL divergence of the next-token distributions from the float
model's. With quantization error shrinking ~4x per extra bit, KL at 5, 6 and 8
bits is predicted from that one measurement, and the combination of bits per
group with the least predicted KL within the bits-per-weight budget is chosen
(an exhaustive search: a few groups, four choices each).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .affine import bits_per_weight, dequantize_rows, quantize_rows

CHOICES = (4, 5, 6, 8)


@dataclass(frozen=True)
class GroupCost:
    group: str
    paths: tuple[str, ...]
    params: int
    kl4: float  # nats per token with only this group at 4 bits


def role(path: str, tied_head: bool) -> str:
    """The group a quantizable layer belongs to."""
    if path == "lm_head" or (tied_head and path == "model.embed_tokens"):
        return "head"
    return path.rsplit(".", 1)[-1]


def layer_groups(paths: list[str], tied_head: bool) -> dict[str, list[str]]:
    """`paths` by the group (role) each belongs to, groups in sorted order."""
    groups: dict[str, list[str]] = {}
    for path in paths:
        groups.setdefault(role(path, tied_head), []).append(path)
    return dict(sorted(groups.items()))


def group_costs(
    model: nn.Module,
    ids: list[int],
    paths: list[str],
    group_size: int,
    tied_head: bool,
    progress: Callable[[], None] | None = None,
):
    """One KL measurement per group of `paths` (fake-quantized to 4 bits, everything else float).

    `progress` is called after each forward pass: the float model's, then each group's."""
    tokens = mx.array(ids)[None]
    reference = nn.log_softmax(model(tokens)[0].astype(mx.float32), axis=-1)
    mx.eval(reference)
    if progress:
        progress()
    params = dict(tree_flatten(model.parameters()))
    costs = []
    for group, members in layer_groups(paths, tied_head).items():
        originals = [(f"{p}.weight", params[f"{p}.weight"]) for p in members]
        fake = [(name, _fake_quantize(w, 4, group_size)) for name, w in originals]
        model.load_weights(fake, strict=False)
        try:
            logits = nn.log_softmax(model(tokens)[0].astype(mx.float32), axis=-1)
            kl = mx.mean(mx.sum(mx.exp(reference) * (reference - logits), axis=-1)).item()
        finally:
            model.load_weights(originals, strict=False)
        costs.append(GroupCost(group, tuple(members), sum(w.size for _, w in originals), max(kl, 0.0)))
        if progress:
            progress()
    return costs


def _fake_quantize(weight: mx.array, bits: int, group_size: int) -> mx.array:
    packed, scales, biases = quantize_rows(weight, bits, group_size, mx.float32)
    return dequantize_rows(packed, scales, biases, bits, group_size).astype(weight.dtype)


def allocate(
    costs: list[GroupCost], bpw: float, group_size: int, fixed_params: int = 0, fixed_bits: float = 0.0
) -> dict[str, int]:
    """Bits per layer path minimizing predicted KL with the average over all weights within `bpw`.

    `fixed_params` weights whose format is already decided (norms in 16 bits) cost `fixed_bits`.
    """
    total = sum(c.params for c in costs) + fixed_params
    budget = bpw * total - fixed_bits
    best, best_kl = (CHOICES[0],) * len(costs), float("inf")
    for combo in itertools.product(CHOICES, repeat=len(costs)):
        spent = sum(c.params * bits_per_weight(b, group_size) for c, b in zip(costs, combo))
        if spent > budget:
            continue
        kl = sum(c.kl4 * 4.0 ** (4 - b) for c, b in zip(costs, combo))
        if kl < best_kl:
            best, best_kl = combo, kl
    return {path: bits for c, bits in zip(costs, best) for path in c.paths}
