"""What the generation loop is given: a loaded model's parts (`ModelRuntime`) and its limits (`SchedulerConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..cache import PrefixCache
from ..defaults import PREFILL_CHUNK_TOKENS, SERVER_PREFILL_CHUNK_TOKENS
from ..errors import ConfigError
from ..memory import ModelFootprint
from ..models.decoder import DecoderLM
from ..tokenizer import Tokenizer
from ..untrusted import shown
from .drafting import DraftRuntime
from .prefill import SNAPSHOT_EVERY
from .speculation import StepCosts


@dataclass(frozen=True)
class ModelRuntime:
    """What the loop needs of a loaded model (`Model.runtime` gives it)."""

    decoder: DecoderLM
    tokenizer: Tokenizer | None  # None: ids only, no text (stop strings need it)
    prefix_cache: PrefixCache | None
    footprint: ModelFootprint | None  # None: no memory fitting (the caller sized the request)
    kv_bits: int | None
    eos_token_ids: frozenset[int]
    context_tokens: int  # the longest sequence the model was trained for
    draft: DraftRuntime | None = None  # a small model with the same tokenizer, for speculative decoding
    step_costs: StepCosts | None = None  # what the model's forward passes cost here, learned (speculation's auto)


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch: int = 8  # sequences decoding together
    max_queue: int = 64  # requests waiting for a place; more are refused (BusyError)
    prefill_chunk: int = SERVER_PREFILL_CHUNK_TOKENS  # tokens per prefill step, between decode steps
    snapshot_every: int = SNAPSHOT_EVERY  # tokens between state snapshots (models with uncuttable layers)
    pipelined: bool = True  # queue the next decode step while this one's tokens are handled (off: to measure it)

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_queue", "prefill_chunk", "snapshot_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"SchedulerConfig.{name} must be a positive integer, got {shown(value)}")


# A single request from the Python API: prefilled in the chunks it asked for, alone in its batch.
SINGLE = SchedulerConfig(max_batch=1, max_queue=1, prefill_chunk=PREFILL_CHUNK_TOKENS)
