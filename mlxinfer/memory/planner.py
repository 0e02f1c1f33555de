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

from ..defaults import PREFILL_CHUNK_TOKENS  # positions a prefill writes at once, unless a plan says otherwise
from ..display import html_table, mib, plural
from ..errors import MemoryBudgetError
from .machine import MachineMemory

KV_STEP = 256  # the KV cache grows in steps of this many positions (cache/kv.py)
PREFIX_CACHE_FRACTION = 0.1  # of usable memory, for the prompt-prefix cache
PREFIX_CACHE_MAX_BYTES = 4 << 30
RUNTIME_BYTES = 64 << 20  # MLX's own buffers, the sampler, the tokenizer's arrays
MAX_SEARCH_CONTEXT = 1 << 24  # max_context() looks no further for a model that states no trained limit


@dataclass(frozen=True)
class ModelFootprint:
    """Sizes that follow from a model's config and the dtype it computes in.

    Each layer keeps one of three kinds of cache: full attention (KV for every
    position: grows with the context), sliding attention (KV for about the last
    `window` positions: bounded) and recurrent (a fixed-size state per sequence).
    """

    weights_bytes: int
    full_layers: int  # full-attention layers: their KV grows with the context
    kv_heads: int  # of the attention layers
    head_dim: int
    heads: int
    hidden: int
    intermediate: int
    vocab: int
    compute_bytes: int  # bytes per activation element
    kv_bytes: float  # bytes per stored K or V element (fractional for quantized KV)
    max_positions: int | None = None  # the context the model was trained for
    sliding_layers: int = 0  # attention layers that keep only a window of positions
    window: int | None = None  # the sliding layers' window
    recurrent_layers: int = 0
    state_bytes: int = 0  # the recurrent layers' state for one sequence, all of them together
    # Mixture of experts: every expert is resident (in weights_bytes), but a decoded token reads only the
    # experts_per_token its router picks in each layer, plus everything dense (shared experts included).
    experts: int = 0  # routed experts per MoE layer; 0 for a dense model
    experts_per_token: int = 0
    expert_bytes: int = 0  # all routed experts' weights, every layer
    active_expert_bytes: int = 0  # the part of them one decoded token reads

    @property
    def decode_weights_bytes(self) -> int:
        """Weight bytes one decoded token reads: the numerator of the bandwidth roofline (tokens/s at most
        bandwidth / these bytes, plus the KV read)."""
        return self.weights_bytes - self.expert_bytes + self.active_expert_bytes

    def expert_lines(self) -> list[str]:
        """The experts and what decoding reads of the weights, in words (none for a dense model).

        Example:
            >>> footprint.expert_lines()
            ['experts: 128, 8 active per token: decode reads 3.89 GB of 30.5 GB']
        """
        if not self.experts:
            return []
        reads, of = _gb(self.decode_weights_bytes), _gb(self.weights_bytes)
        return [f"experts: {self.experts}, {self.experts_per_token} active per token: decode reads {reads} of {of}"]

    def expert_counts(self) -> dict[str, int] | None:
        """The experts as numbers (for JSON); None for a dense model."""
        if not self.experts:
            return None
        return {
            "experts": self.experts,
            "experts_per_token": self.experts_per_token,
            "expert_bytes": self.expert_bytes,
            "active_expert_bytes": self.active_expert_bytes,
        }

    @property
    def kv_bytes_per_position(self) -> int:
        """K and V of one position in one attention layer."""
        return int(2 * self.kv_heads * self.head_dim * self.kv_bytes)

    @property
    def kv_bytes_per_token(self) -> int:
        """What each more token of context adds: one position in every full-attention layer."""
        return self.full_layers * self.kv_bytes_per_position

    @property
    def grows(self) -> bool:
        """Whether some layer's cache grows with the context (a full-attention layer)."""
        return self.full_layers > 0

    def sliding_positions(self, tokens: int, chunk: int = PREFILL_CHUNK_TOKENS) -> int:
        """Positions one sliding layer's cache holds at most over `tokens` positions written `chunk` at a time.

        cache/kv.py keeps the last window - 1 positions when a write of up to `chunk`
        would outgrow the storage, and allocates them a step of slack on top.
        """
        if tokens <= 0 or not self.sliding_layers:
            return 0
        if self.window is None:  # no window after all: it holds every position
            return _steps(tokens)
        return _steps(min(tokens, self.window - 1 + chunk)) + KV_STEP

    def full_kv_bytes(self, tokens: int) -> int:
        """The full-attention layers' KV for `tokens` positions, growth steps included."""
        return self.kv_bytes_per_token * _steps(tokens)

    def sliding_kv_bytes(self, tokens: int, chunk: int = PREFILL_CHUNK_TOKENS) -> int:
        """The sliding layers' KV at most, at `tokens` positions: it stops growing near the window."""
        return self.sliding_layers * self.kv_bytes_per_position * self.sliding_positions(tokens, chunk)

    def kv_cache_bytes(self, tokens: int, chunk: int = PREFILL_CHUNK_TOKENS) -> int:
        """The attention layers' KV allocation for `tokens` positions prefilled `chunk` at a time."""
        return self.full_kv_bytes(tokens) + self.sliding_kv_bytes(tokens, chunk)

    def cache_bytes(self, tokens: int, chunk: int = PREFILL_CHUNK_TOKENS) -> int:
        """Everything one sequence's cache holds at `tokens` positions: KV and recurrent state."""
        return self.kv_cache_bytes(tokens, chunk) + self.state_bytes

    def attended_positions(self, chunk: int, context: int) -> int:
        """Keys a query of a chunk ending at `context` attends to in the widest attention layer."""
        if self.full_layers or self.window is None:
            return context
        return min(context, self.window - 1 + chunk)

    def activation_bytes(self, chunk: int, context: int) -> int:
        """Peak temporaries of one prefill chunk of `chunk` tokens ending at position `context`."""
        per_block = (
            4 * chunk * self.hidden
            + 2 * chunk * (self.heads + 2 * self.kv_heads) * self.head_dim
            + 2 * self.heads * chunk * self.attended_positions(chunk, context)
            + 3 * chunk * self.intermediate
        )
        return self.compute_bytes * (per_block + self.vocab)

    def request_peak_bytes(self, prompt: int, total: int, chunk: int) -> int:
        """Weights plus the fullest moment of a request: some prefill chunk, or decoding at `total` positions.

        The cache and temporaries both grow with a chunk's end, so only the last full
        chunk and the final partial one can be the fullest prefill moment.
        """
        full_end = prompt // chunk * chunk
        moments = [self.cache_bytes(total, chunk) + self.activation_bytes(1, total)]
        if full_end:
            moments.append(self.cache_bytes(full_end, chunk) + self.activation_bytes(chunk, full_end))
        if prompt > full_end:
            moments.append(self.cache_bytes(prompt, chunk) + self.activation_bytes(prompt - full_end, prompt))
        return self.weights_bytes + max(moments)

    def cache_lines(self, context: int, chunk: int = PREFILL_CHUNK_TOKENS) -> list[str]:
        """What each kind of layer keeps at `context` tokens, in words (the `plan` command prints these).

        Example:
            >>> footprint.cache_lines(32768)
            ['KV cache: 5 sliding layers (window 1024) bounded at 1792 positions (35.0 MiB), 1 full layer grows
              (128.0 MiB at 32768 tokens)']
        """
        parts = []
        if self.sliding_layers:
            held = self.sliding_positions(context, chunk)
            parts.append(
                f"{plural(self.sliding_layers, 'sliding layer')} (window {self.window}) bounded at {held} positions"
                f" ({_size(self.sliding_kv_bytes(context, chunk))})"
            )
        if self.full_layers:
            grows = "grows" if self.full_layers == 1 else "grow"
            size = _size(self.full_kv_bytes(context))
            parts.append(f"{plural(self.full_layers, 'full layer')} {grows} ({size} at {context} tokens)")
        elif self.sliding_layers:
            parts.append("no layer grows with the context")
        lines = [f"KV cache: {', '.join(parts)}"] if parts else []
        if self.recurrent_layers:
            state = _size(self.state_bytes)
            lines.append(f"{plural(self.recurrent_layers, 'recurrent layer')}: {state} of state per sequence")
        return lines

    def layer_counts(self, context: int, chunk: int = PREFILL_CHUNK_TOKENS) -> dict[str, Any]:
        """The cache of each kind of layer at `context` tokens, as numbers (for JSON)."""
        return {
            "full_layers": self.full_layers,
            "full_kv_bytes": self.full_kv_bytes(context),
            "sliding_layers": self.sliding_layers,
            "window": self.window,
            "sliding_positions": self.sliding_positions(context, chunk),
            "sliding_kv_bytes": self.sliding_kv_bytes(context, chunk),
            "recurrent_layers": self.recurrent_layers,
            "state_bytes_per_sequence": self.state_bytes,
        }


def _steps(tokens: int) -> int:
    """`tokens` rounded up to whole growth steps: the positions a growing cache allocates."""
    return KV_STEP * math.ceil(max(tokens, 0) / KV_STEP)


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
        kv = f.kv_cache_bytes(self.context, self.prefill_chunk)
        prompt = self.context if self.prompt is None else min(self.prompt, self.context)
        peak = f.request_peak_bytes(prompt, self.context, self.prefill_chunk)
        parts = {"weights": f.weights_bytes, "kv cache": kv}
        if f.recurrent_layers:
            parts["recurrent state"] = f.state_bytes
        # beyond the final cache, at the fullest moment
        parts["prefill activations"] = peak - f.weights_bytes - kv - f.state_bytes
        parts["prefix cache"] = self.prefix_cache_bytes
        parts["runtime"] = RUNTIME_BYTES
        return parts

    def cache_lines(self) -> list[str]:
        """What each kind of layer keeps at this plan's context, in words."""
        return self.footprint.cache_lines(self.context, self.prefill_chunk)

    def lines(self) -> list[str]:
        """What decoding reads of the weights (MoE), then what each kind of layer keeps, in words."""
        return self.footprint.expert_lines() + self.cache_lines()

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
        elif trained is None and not self.footprint.grows:
            why = "no layer's cache grows with the context, so memory sets no limit on it (the model states no limit)"
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
        rows += [("experts", line) for line in self.footprint.expert_lines()]
        rows += [("layers", line) for line in self.cache_lines()]
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
            "layers": self.footprint.layer_counts(self.context, self.prefill_chunk),
            "weights_bytes": self.footprint.weights_bytes,
            "decode_weights_bytes": self.footprint.decode_weights_bytes,  # what one decoded token reads
            "experts": self.footprint.expert_counts(),
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
    prefill_chunk: int = PREFILL_CHUNK_TOKENS,
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
    as many positions as the longest (a sliding layer at most its window's; a recurrent
    layer keeps one state per row). While a row joins, the old batch, its padded copy and
    the new batch exist together with the joining row's own cache.
    """
    if not rows:
        return footprint.weights_bytes
    batch_kv = len(rows) * footprint.cache_bytes(max(rows), chunk)
    prefill = footprint.cache_bytes(prompt, chunk) + footprint.activation_bytes(min(chunk, prompt), prompt)
    joining = batch_kv + footprint.cache_bytes(prompt, chunk)  # beyond the batch_kv counted below
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


def _size(n: int) -> str:
    """MiB, or KiB for what would show as 0.0 MiB (a tiny model's state)."""
    return mib(n) if n >= 2**20 // 20 else f"{n / 1024:,.1f} KiB"


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _gb(n: int) -> str:
    """Decimal units, as bandwidth is quoted (GB/s), with three significant digits."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"
