"""Numbers recorded for every generation."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..display import html_table, mib


@dataclass
class GenerationStats:
    """Timings and sizes of one generation. Rates are tokens per second."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    prefilled_tokens: int = 0  # prompt tokens run through the model
    prefill_chunk: int = 0  # tokens per prefill step it ran with (halved while memory was short)
    diverged_at: int | None = None  # on a partial hit, where the prompt left the best cached entry
    cache_note: str = ""  # on a hit, where the prompt resumed and why (a snapshot may sit before the shared part)
    generated_tokens: int = 0
    queued_s: float = 0.0  # waiting for a place in the batch (served requests only)
    ttft_s: float = 0.0
    prefill_tps: float = 0.0
    decode_tps: float = 0.0
    total_s: float = 0.0
    peak_memory_bytes: int = 0
    finish_reason: str = ""  # "stop" (EOS or stop string), "length" (max_tokens or time limit) or "cancelled"
    stop_sequence: str = ""  # the stop string generation stopped at ("" for EOS or any other reason)
    speculation: str = ""  # the drafter it decoded with: "lookup", "draft", or "" (plain decoding)
    drafted_tokens: int = 0  # drafts the target verified
    accepted_tokens: int = 0  # of those, the ones it kept
    target_steps: int = 0  # the target's decode forward passes while speculating (verifications and plain steps)
    speculation_off: str = ""  # why speculation stopped or never started (auto), "" if it did not
    speculation_switched_off: int = 0  # times auto stopped speculating because it was slower
    draft_declined: str = ""  # why auto drafted by prompt lookup though a draft model was loaded, "" if it did not

    @property
    def acceptance_rate(self) -> float | None:
        """Share of verified drafts the target kept (None: nothing was drafted)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None

    @property
    def tokens_per_step(self) -> float | None:
        """Tokens each forward pass of the target gave while speculating (plain decoding: 1)."""
        return self.accepted_tokens / self.target_steps + 1 if self.target_steps else None

    def first_token(self, ttft_s: float, prefill_s: float) -> None:
        """The first token came `ttft_s` after the request, its prefill having taken `prefill_s`."""
        self.ttft_s = ttft_s
        self.prefill_tps = self.prefilled_tokens / max(prefill_s, 1e-9)

    def decoded(self, tokens_after_first: int, seconds: float) -> None:
        """`tokens_after_first` tokens followed the first one within `seconds`."""
        if tokens_after_first > 0:
            self.decode_tps = tokens_after_first / max(seconds, 1e-9)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "acceptance_rate": self.acceptance_rate, "tokens_per_step": self.tokens_per_step}

    def _repr_html_(self) -> str:
        rows = [
            ("prompt tokens", f"{self.prompt_tokens} ({self.cached_tokens} from the prefix cache)"),
            ("generated tokens", f"{self.generated_tokens} (finish: {self.finish_reason or '-'})"),
            ("time to first token", f"{self.ttft_s:.3f} s"),
            ("prefill", f"{self.prefill_tps:.1f} tokens/s"),
            ("decode", f"{self.decode_tps:.1f} tokens/s"),
            ("peak memory", mib(self.peak_memory_bytes)),
        ]
        if self.speculation or self.speculation_off:  # (draft_declined comes with speculation = "lookup")
            rows.append(("speculation", self.speculation_summary()))
        return html_table("Generation", rows)

    def summary(self) -> str:
        cached = f" ({self.cached_tokens} cached)" if self.cached_tokens else ""
        return (
            f"{self.prompt_tokens} prompt tokens{cached}, {self.generated_tokens} generated; "
            f"TTFT {self.ttft_s:.2f} s, prefill {self.prefill_tps:.1f} tok/s, "
            f"decode {self.decode_tps:.1f} tok/s"
            + (f", peak {mib(self.peak_memory_bytes, 0)}" if self.peak_memory_bytes else "")  # 0: not measured here
            + (f"; speculation: {self.speculation_summary()}" if self.speculation or self.speculation_off else "")
        )

    def speculation_summary(self) -> str:
        """What speculation did: the drafter, the share of drafts kept, tokens per target step, and why it stopped."""
        parts = []
        if self.speculation:
            rate = f"{self.acceptance_rate:.0%} of {self.drafted_tokens} drafts kept" if self.drafted_tokens else ""
            per_step = f"{self.tokens_per_step:.2f} tokens per step" if self.target_steps else ""
            parts.append(f"{self.speculation} ({', '.join(p for p in (rate, per_step) if p) or 'no drafts'})")
        if self.speculation_off:
            parts.append(f"off: {self.speculation_off}")
        if self.draft_declined:
            parts.append(f"draft model not used: {self.draft_declined}")
        return "; ".join(parts)
