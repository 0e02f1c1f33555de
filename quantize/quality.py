"""What quantization cost: perplexity of source and output, and the KL divergence
between their next-token distributions, on the same calibration tokens.

Both models run over the text one chunk at a time with their KV caches, and only
running sums are kept, so memory holds one chunk's logits, never the whole text's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from mlxinfer.display import html_table
from mlxinfer.errors import SamplingError

EVAL_CHUNK_TOKENS = 32  # tokens per forward pass: a progress tick every few seconds on a CPU
# When a report says the output answers noticeably worse than its source. Measured on
# SmolLM2-135M-Instruct over 512 tokens of the shipped prose, with the greedy answer to
# "What is the capital of France?": 4-bit round-to-nearest +24.8% perplexity, KL 0.46,
# broken French; 4-bit mixed-4-8 +14.3%, KL 0.32, broken French; 4-bit GPTQ +21.1%,
# KL 0.19, "Paris" and a ramble; sensitivity at 4.75 bits/weight +8.0%, KL 0.08, "Paris"
# and a ramble; 8-bit -0.5%, KL 0.003, "The capital of France is Paris." Uniform 4-bit
# variants cost 14-25% and some answer wrongly; 10% and 0.2 nats sit between the two.
WARN_PPL_CHANGE_PCT = 10.0
WARN_MEAN_KL = 0.2  # nats per token

Progress = Callable[[int], None]  # called with the number of tokens a model has just scored


@dataclass
class QualityReport:
    """Quality of a converted model against its source on `tokens` tokens of text.

    `advice` is what to try instead when `warning` is set (the converter fills it in:
    it knows which settings made the output).
    """

    tokens: int
    source_ppl: float
    output_ppl: float
    mean_kl: float  # nats per token, KL(source || output)
    bits_per_weight: float | None = None
    advice: str | None = None

    @property
    def ppl_change_pct(self) -> float:
        return 100.0 * (self.output_ppl / self.source_ppl - 1.0)

    @property
    def warning(self) -> str | None:
        """A plain sentence when the output is measurably worse than its source, else None."""
        if self.ppl_change_pct <= WARN_PPL_CHANGE_PCT and self.mean_kl <= WARN_MEAN_KL:
            return None
        advice = f"; {self.advice}" if self.advice else ""
        return (
            f"quality warning: perplexity {self.ppl_change_pct:+.1f}% and mean KL {self.mean_kl:.2f} nats over "
            f"{self.tokens} tokens (limits: {WARN_PPL_CHANGE_PCT:+.0f}%, {WARN_MEAN_KL}): this model will answer "
            f"noticeably worse than its source{advice}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ppl_change_pct": self.ppl_change_pct, "warning": self.warning}

    def summary(self) -> str:
        bpw = f", {self.bits_per_weight:.2f} bits/weight" if self.bits_per_weight else ""
        return (
            f"perplexity {self.source_ppl:.3f} -> {self.output_ppl:.3f} ({self.ppl_change_pct:+.2f}%), "
            f"mean KL {self.mean_kl:.4f} nats over {self.tokens} tokens{bpw}"
        )

    def _repr_html_(self) -> str:
        rows = [
            ("tokens", self.tokens),
            ("source perplexity", f"{self.source_ppl:.3f}"),
            ("output perplexity", f"{self.output_ppl:.3f} ({self.ppl_change_pct:+.2f}%)"),
            ("mean KL (nats)", f"{self.mean_kl:.4f}"),
            ("bits per weight", f"{self.bits_per_weight:.2f}" if self.bits_per_weight else "-"),
        ]
        if self.warning:
            rows.append(("warning", self.warning))
        return html_table("Quantization quality", rows)


def log_probs(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64 for stable sums."""
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def scoring_bytes(vocab: int, compute_size: int, chunk_tokens: int = EVAL_CHUNK_TOKENS) -> int:
    """Working memory of one chunk of `compare_models`: each model's logits in MLX (in the compute
    dtype of `compute_size` bytes, then cast to float32) and as a float32 numpy copy, the float64
    log-probabilities of both, and log_probs' and the KL's temporaries."""
    per_model = compute_size + 4 + 4
    return chunk_tokens * vocab * (2 * per_model + 6 * 8)


def perplexity(
    model: Any, ids: Sequence[int], chunk_tokens: int = EVAL_CHUNK_TOKENS, progress: Progress | None = None
) -> float:
    """exp(mean negative log-likelihood) of ids[1:] given their prefixes."""
    scored = _scored_count(ids)
    nll = 0.0
    for (lp,), rows, targets in _scored_chunks([model], ids, chunk_tokens, progress):
        nll -= lp[rows, targets].sum()
    return math.exp(nll / scored)


def compare_models(
    source: Any,
    output: Any,
    ids: Sequence[int],
    bits_per_weight: float | None = None,
    chunk_tokens: int = EVAL_CHUNK_TOKENS,
    progress: Progress | None = None,
) -> QualityReport:
    """Perplexities of both models and the mean KL(source || output) per position."""
    scored = _scored_count(ids)
    nll_source = nll_output = kl = 0.0
    for (src, out), rows, targets in _scored_chunks([source, output], ids, chunk_tokens, progress):
        nll_source -= src[rows, targets].sum()
        nll_output -= out[rows, targets].sum()
        kl += (np.exp(src) * (src - out)).sum()
    return QualityReport(
        tokens=len(ids),
        source_ppl=math.exp(nll_source / scored),
        output_ppl=math.exp(nll_output / scored),
        mean_kl=float(kl / scored),
        bits_per_weight=bits_per_weight,
    )


def _scored_count(ids: Sequence[int]) -> int:
    """How many tokens are scored: each one after the first, given the ones before it."""
    if len(ids) < 2:
        raise SamplingError(f"scoring a text needs at least 2 tokens (the first is only context), got {len(ids)}")
    return len(ids) - 1


def _scored_chunks(
    models: list[Any], ids: Sequence[int], chunk_tokens: int, progress: Progress | None
) -> Iterator[tuple[list[np.ndarray], np.ndarray, np.ndarray]]:
    """Per chunk: each model's log-probabilities at the positions that predict a known
    next token, their row indices, and those tokens."""
    streams = [model.logit_chunks(ids, chunk_tokens) for model in models]
    for start in range(0, len(ids), chunk_tokens):
        parts = []
        for stream in streams:
            parts.append(next(stream))
            if progress:
                progress(len(parts[-1]))
        # The text's last position predicts a token past its end: nothing to score.
        targets = np.asarray(ids[start + 1 : start + 1 + len(parts[0])])
        if len(targets):
            yield [log_probs(p[: len(targets)]) for p in parts], np.arange(len(targets)), targets
