"""What quantization cost: perplexity of source and output, and the KL divergence
between their next-token distributions, on the same calibration tokens."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from mlxinfer.display import html_table


@dataclass
class QualityReport:
    """Quality of a converted model against its source on `tokens` tokens of text."""

    tokens: int
    source_ppl: float
    output_ppl: float
    mean_kl: float  # nats per token, KL(source || output)
    bits_per_weight: float | None = None

    @property
    def ppl_change_pct(self) -> float:
        return 100.0 * (self.output_ppl / self.source_ppl - 1.0)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ppl_change_pct": self.ppl_change_pct}

    def summary(self) -> str:
        bpw = f", {self.bits_per_weight:.2f} bits/weight" if self.bits_per_weight else ""
        return (
            f"perplexity {self.source_ppl:.3f} -> {self.output_ppl:.3f} ({self.ppl_change_pct:+.2f}%), "
            f"mean KL {self.mean_kl:.4f} nats over {self.tokens} tokens{bpw}"
        )

    def _repr_html_(self) -> str:
        return html_table(
            "Quantization quality",
            [
                ("tokens", self.tokens),
                ("source perplexity", f"{self.source_ppl:.3f}"),
                ("output perplexity", f"{self.output_ppl:.3f} ({self.ppl_change_pct:+.2f}%)"),
                ("mean KL (nats)", f"{self.mean_kl:.4f}"),
                ("bits per weight", f"{self.bits_per_weight:.2f}" if self.bits_per_weight else "-"),
            ],
        )


def log_probs(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64 for stable sums."""
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def perplexity(model: Any, ids: list[int]) -> float:
    """exp(mean negative log-likelihood) of ids[1:] given their prefixes."""
    lp = log_probs(model.logits(ids)[:-1])
    return math.exp(-lp[np.arange(len(ids) - 1), ids[1:]].mean())


def compare_models(source: Any, output: Any, ids: list[int], bits_per_weight: float | None = None) -> QualityReport:
    """Perplexities of both models and the mean KL(source || output) per position."""
    src, out = log_probs(source.logits(ids)[:-1]), log_probs(output.logits(ids)[:-1])
    targets = np.arange(len(ids) - 1), ids[1:]
    kl = (np.exp(src) * (src - out)).sum(axis=-1).mean()
    return QualityReport(
        tokens=len(ids),
        source_ppl=math.exp(-src[targets].mean()),
        output_ppl=math.exp(-out[targets].mean()),
        mean_kl=float(kl),
        bits_per_weight=bits_per_weight,
    )
