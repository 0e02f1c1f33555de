"""One memory budget for weights, KV cache, prefill activations and the prefix cache.

Everything here is arithmetic on sizes, so a plan costs nothing to make and can
be checked before every request. The activation model counts what one prefill
chunk keeps alive inside one block (MLX frees a block's temporaries before the
next block runs): hidden-state copies, q/k/v, the attention scores and their
softmax, and the MLP's three intermediate tensors.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ..display import html_table, mib
from ..errors import MemoryBudgetError
from .machine import MachineMemory

KV_STEP = 256  # the KV cache grows in steps of this many positions (cache/kv.py)
PREFIX_CACHE_FRACTION = 0.1  # of usable memory, for the prompt-prefix cache
PREFIX_CACHE_MAX_BYTES = 4 << 30
RUNTIME_BYTES = 64 << 20  # MLX's own buffers, the sampler, the tokenizer's arrays
MAX_SEARCH_CONTEXT = 1 << 24  # max_context() looks no further for a model that states no trained limit


@dataclass(frozen=True)
class ModelFootprint:
    """Sizes that follow from a model's config and the dtype it computes in."""

    weights_bytes: int
    layers: int
    kv_heads: int
    head_dim: int
    heads: int
    hidden: int
    intermediate: int
    vocab: int
    compute_bytes: int  # bytes per activation element
    kv_bytes: float  # bytes per stored K or V element (fractional for quantized KV)
    max_positions: int | None = None  # the context the model was trained for

    @property
    def kv_bytes_per_token(self) -> int:
        return int(2 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes)

    def kv_cache_bytes(self, tokens: int) -> int:
        """The KV cache's allocation for `tokens` positions, growth steps included."""
        return self.kv_bytes_per_token * KV_STEP * math.ceil(tokens / KV_STEP)

    def activation_bytes(self, chunk: int, context: int) -> int:
        """Peak temporaries of one prefill chunk of `chunk` tokens ending at position `context`."""
        per_block = (
            4 * chunk * self.hidden
            + 2 * chunk * (self.heads + 2 * self.kv_heads) * self.head_dim
            + 2 * self.heads * chunk * context
            + 3 * chunk * self.intermediate
        )
        return self.compute_bytes * (per_block + self.vocab)

    def request_peak_bytes(self, prompt: int, total: int, chunk: int) -> int:
        """Weights plus the fullest moment of a request: some prefill chunk, or decoding at `total` positions.

        KV and temporaries both grow with a chunk's end, so only the last full chunk
        and the final partial one can be the fullest prefill moment.
        """
        full_end = prompt // chunk * chunk
        moments = [self.kv_cache_bytes(total) + self.activation_bytes(1, total)]
        if full_end:
            moments.append(self.kv_cache_bytes(full_end) + self.activation_bytes(chunk, full_end))
        if prompt > full_end:
            moments.append(self.kv_cache_bytes(prompt) + self.activation_bytes(prompt - full_end, prompt))
        return self.weights_bytes + max(moments)


@dataclass(frozen=True)
class MemoryPlan:
    """What a model at `context` tokens needs against what this machine can give."""

    machine: MachineMemory
    footprint: ModelFootprint
    context: int  # positions in the KV cache at the end: prompt + generated tokens
    prefill_chunk: int
    usable_bytes: int
    prefix_cache_bytes: int
    prompt: int | None = None  # tokens to prefill; None: the whole context is prompt

    @property
    def parts(self) -> dict[str, int]:
        f = self.footprint
        kv = f.kv_cache_bytes(self.context)
        prompt = self.context if self.prompt is None else min(self.prompt, self.context)
        peak = f.request_peak_bytes(prompt, self.context, self.prefill_chunk)
        return {
            "weights": f.weights_bytes,
            "kv cache": kv,
            "prefill activations": peak - f.weights_bytes - kv,  # beyond the final KV, at the fullest moment
            "prefix cache": self.prefix_cache_bytes,
            "runtime": RUNTIME_BYTES,
        }

    @property
    def needed_bytes(self) -> int:
        return sum(self.parts.values())

    @property
    def verdict(self) -> str:
        if self.needed_bytes > self.usable_bytes + self.machine.headroom_bytes:
            return "does not fit"
        if self.needed_bytes > self.usable_bytes or self.machine.swap_used_bytes > self.machine.total_bytes // 10:
            return "fits but risks swap"
        return "fits"

    def max_context(self) -> int:
        """The longest context (up to the trained one) whose plan still fits without risking swap."""
        low, high = 0, self.footprint.max_positions or MAX_SEARCH_CONTEXT
        while low < high:
            mid = (low + high + 1) // 2
            if _with(self, context=mid).needed_bytes <= self.usable_bytes:
                low = mid
            else:
                high = mid - 1
        return low

    def context_limit(self) -> str:
        """Why max_context() is what it is (memory, the trained context, or how far the plan looks), in a sentence.

        A plan for a context past the trained one says so too, whichever limit is the tighter.

        Example:
            >>> plan.context_limit()
            "the model's trained limit is 8192 tokens (max_position_embeddings); 32768 is past it (...)"
        """
        longest, trained = self.max_context(), self.footprint.max_positions
        past = trained is not None and self.context > trained  # the plan is for the context asked, not the trained one
        refused = "`serve` refuses longer requests"
        if longest < (trained or MAX_SEARCH_CONTEXT):
            why = f"memory is the limit: the largest context that fits is {longest} tokens"
            if past:
                why += f"; {self.context} is also past the model's trained limit of {trained} tokens"
                why += f" (max_position_embeddings; {refused})"
        elif trained is None:
            why = f"memory allows at least {longest} tokens, as far as the plan looks (the model states no limit)"
        else:
            why = f"the model's trained limit is {trained} tokens (max_position_embeddings)"
            why += f"; {self.context} is past it ({refused})" if past else ", and memory allows all of it"
        return why

    def suggestions(self) -> list[str]:
        if self.verdict == "fits":
            return []
        f, tips = self.footprint, []
        longest = self.max_context()
        if 0 < longest < self.context:
            tips.append(f"use a context of at most {longest} tokens")
        if f.kv_bytes >= 1:
            tips.append("quantize the KV cache (--kv-bits 8 or 4)")
        tips.append("convert the model to fewer bits (mlxinfer convert --bits 4)")
        tips.append("close memory-hungry apps, or lower the prefix cache (prefix_cache_bytes=0)")
        return tips

    def _repr_html_(self) -> str:
        rows = [(part, mib(size)) for part, size in self.parts.items()]
        rows += [("needed", mib(self.needed_bytes)), ("usable", mib(self.usable_bytes)), ("verdict", self.verdict)]
        rows += [("largest context that fits", f"{self.max_context()} tokens"), ("limit", self.context_limit())]
        rows += [("suggestion", tip) for tip in self.suggestions()]
        return html_table(f"Memory plan: {self.context} tokens on {self.machine.backend}", rows)

    def to_dict(self) -> dict[str, Any]:
        return {
            "machine": asdict(self.machine),
            "context": self.context,
            "prefill_chunk": self.prefill_chunk,
            "parts": self.parts,
            "needed_bytes": self.needed_bytes,
            "usable_bytes": self.usable_bytes,
            "verdict": self.verdict,
            "max_context": self.max_context(),
            "context_limit": self.context_limit(),
            "suggestions": self.suggestions(),
        }

    def check(self) -> None:
        """Raise MemoryBudgetError, with the numbers and the fixes, unless the plan fits."""
        if self.needed_bytes > self.usable_bytes:
            raise MemoryBudgetError(
                f"{self.context} tokens need {_gib(self.needed_bytes)} (weights {_gib(self.footprint.weights_bytes)}, "
                f"KV {_gib(self.parts['kv cache'])}) but {_gib(self.usable_bytes)} can be used; "
                + "; ".join(self.suggestions())
            )


def plan_memory(
    machine: MachineMemory,
    footprint: ModelFootprint,
    context: int,
    prefill_chunk: int = 512,
    prefix_cache_bytes: int | None = None,
    already_ours: int = 0,
    prompt: int | None = None,
) -> MemoryPlan:
    """The plan for `context` positions of which `prompt` are prefilled (default: all);
    `already_ours` is memory this process already holds (loaded weights, cached prefixes)."""
    usable = machine.usable_bytes(already_ours)
    if prefix_cache_bytes is None:
        prefix_cache_bytes = default_prefix_cache_bytes(machine)
    return MemoryPlan(machine, footprint, context, prefill_chunk, usable, prefix_cache_bytes, prompt)


def batch_peak_bytes(footprint: ModelFootprint, rows: Sequence[int], prompt: int, chunk: int) -> int:
    """Weights, `rows` sequences decoding together and one prefill chunk of a `prompt`-token request.

    `rows` are the positions each sequence may reach (prompt + max_tokens, the one
    being prefilled included). Rows are right-aligned in one cache, so each takes
    as many positions as the longest. While a row joins, the old batch, its padded copy and
    the new batch exist together with the joining row's own cache.
    """
    if not rows:
        return footprint.weights_bytes
    batch_kv = len(rows) * footprint.kv_cache_bytes(max(rows))
    prefill = footprint.kv_cache_bytes(prompt) + footprint.activation_bytes(min(chunk, prompt), prompt)
    joining = batch_kv + footprint.kv_cache_bytes(prompt)  # beyond the batch_kv counted below
    return footprint.weights_bytes + batch_kv + max(prefill, joining) + RUNTIME_BYTES


def default_prefix_cache_bytes(machine: MachineMemory | None = None) -> int:
    """A tenth of usable memory, at most 4 GiB: room for many system prompts and chats, never the lion's share."""
    from .machine import machine_memory

    machine = machine or machine_memory()
    return min(PREFIX_CACHE_MAX_BYTES, int(PREFIX_CACHE_FRACTION * machine.usable_bytes()))


def fit_prefill_chunk(plan: MemoryPlan) -> int:
    """The largest prefill chunk (halving from the plan's) whose activations fit; raises if none does."""
    chunk = plan.prefill_chunk
    while chunk > 16 and _with(plan, prefill_chunk=chunk).needed_bytes > plan.usable_bytes:
        chunk //= 2
    _with(plan, prefill_chunk=chunk).check()
    return chunk


def _with(plan: MemoryPlan, **changes: Any) -> MemoryPlan:
    return dataclasses.replace(plan, **changes)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
