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

    def first_token(self, ttft_s: float, prefill_s: float) -> None:
        """The first token came `ttft_s` after the request, its prefill having taken `prefill_s`."""
        self.ttft_s = ttft_s
        self.prefill_tps = self.prefilled_tokens / max(prefill_s, 1e-9)

    def decoded(self, tokens_after_first: int, seconds: float) -> None:
        """`tokens_after_first` tokens followed the first one within `seconds`."""
        if tokens_after_first > 0:
            self.decode_tps = tokens_after_first / max(seconds, 1e-9)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def _repr_html_(self) -> str:
        rows = [
            ("prompt tokens", f"{self.prompt_tokens} ({self.cached_tokens} from the prefix cache)"),
            ("generated tokens", f"{self.generated_tokens} (finish: {self.finish_reason or '-'})"),
            ("time to first token", f"{self.ttft_s:.3f} s"),
            ("prefill", f"{self.prefill_tps:.1f} tokens/s"),
            ("decode", f"{self.decode_tps:.1f} tokens/s"),
            ("peak memory", mib(self.peak_memory_bytes)),
        ]
        return html_table("Generation", rows)

    def summary(self) -> str:
        cached = f" ({self.cached_tokens} cached)" if self.cached_tokens else ""
        return (
            f"{self.prompt_tokens} prompt tokens{cached}, {self.generated_tokens} generated; "
            f"TTFT {self.ttft_s:.2f} s, prefill {self.prefill_tps:.1f} tok/s, "
            f"decode {self.decode_tps:.1f} tok/s, peak {mib(self.peak_memory_bytes, 0)}"
        )
