"""What `mlxinfer convert SRC -o OUT` converts with when no recipe flag is given (`--bits 4` alone included).

Round-to-nearest 4-bit group 64 answers the README's question wrongly on SmolLM2-135M-Instruct ("L'Alogueur de
France", +50.3% perplexity on held-out code, prose and chat). The learned recipe below keeps 1.06x plain 4-bit's
size (4.75 against 4.5 bits per weight) and measures +10.3% on the same held-out text, answering "Paris"
(bench/README.md). It runs the whole source model, so it costs time and memory that streaming does not: where
the source cannot be calibrated, or the machine cannot hold it, the conversion rounds to nearest instead and the
plan line says why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlxinfer.errors import MemoryBudgetError
from mlxinfer.models.config import ModelConfig
from mlxinfer.models.sizing import refuse_beyond_machine

LEARNED_BPW = 4.75
FLAGS = f"--recipe sensitivity --bpw {LEARNED_BPW} --method dwq --calibration mixed"
# Measured: SmolLM2-135M-Instruct (135M parameters) in 4 min 27 s, quality report included, on this project's
# 2-core x86 CPU (bench/README.md); its steps scale with the parameters (a fixed number of calibration tokens).
MINUTES_PER_BILLION = 36


@dataclass(frozen=True)
class DefaultChoice:
    """The default's outcome: `learned` (the recipe above applied) or round-to-nearest, and the plan line's words."""

    learned: bool
    note: str


def choose(
    settings: Any, config: ModelConfig, params: int, moe: bool, block_quantized: bool, learned_peak: int, source: str
) -> DefaultChoice | None:
    """None when a flag picks the recipe (`settings` as given); else settle `settings` on the learned recipe unless
    this source or machine rules it out (`learned_peak`: what running it peaks at), or on round-to-nearest."""
    asked = (settings.recipe, settings.bpw, settings.method, settings.group_size) == (None,) * 4
    if not (asked and settings.mode == "affine" and settings.bits in (None, 4)):
        return None
    reason = why_not_learned(config, moe, block_quantized, learned_peak, source)
    if reason is not None:
        settings.method = "rtn"
        return DefaultChoice(False, f"round-to-nearest, not the learned default: {reason}")
    settings.recipe, settings.bpw, settings.method = "sensitivity", LEARNED_BPW, "dwq"
    settings.calibration = settings.calibration or "mixed"
    return DefaultChoice(True, f"the learned default {FLAGS}; {_duration(params)}; --method rtn takes seconds")


def why_not_learned(
    config: ModelConfig, moe: bool, block_quantized: bool, learned_peak: int, source: str
) -> str | None:
    """Why the learned recipe cannot run on this source and machine; None when it can."""
    reason = _ruled_out(config, moe, block_quantized)
    if reason is None:
        try:
            refuse_beyond_machine(learned_peak, "the learned 4-bit recipe's calibration", source)
        except MemoryBudgetError as e:
            reason = str(e).removeprefix(f"{source}: ").split("; use a smaller")[0]
    return reason


def _duration(params: int) -> str:
    minutes = MINUTES_PER_BILLION * params / 1e9
    took = "under a minute" if minutes < 1 else f"about {minutes:.0f} min"
    return f"{took} on a 2-core CPU at {MINUTES_PER_BILLION} min per billion parameters"


def _ruled_out(config: ModelConfig, moe: bool, block_quantized: bool) -> str | None:
    if block_quantized:
        return "the GGUF file's own quantized blocks are kept"
    if config.spec.recurrent_kinds:
        return f"model_type {config.model_type!r} has recurrent layers, which calibration cannot run yet"
    if not config.verified:
        return f"model_type {config.model_type!r} is unverified (mlx-lm's model code runs it)"
    if moe:
        return f"the experts of model_type {config.model_type!r} cannot be calibrated yet"
    return None
