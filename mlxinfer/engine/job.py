"""One request as the scheduler sees it: what to generate, and where its events go.

The scheduler runs on its own thread and reports through `on_event`, called on
that thread; a server hands the events to its event loop from there.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from ..adapters import NO_ADAPTER, Chosen
from ..defaults import DEFAULT_MAX_TOKENS
from ..grammar import Constraint
from .images import PromptImages
from .sampling import SamplingParams
from .stats import GenerationStats
from .text import check_stops


@dataclass(frozen=True)
class Delta:
    """One generated token's text (maybe "", held back) or, with tokens=0, text held back until the end."""

    text: str
    tokens: int
    token: int | None = None  # the token's id (None for held-back text)


@dataclass(frozen=True)
class Finished:
    """The generation ended normally; `stats.finish_reason` says why."""

    stats: GenerationStats


@dataclass(frozen=True)
class Failed:
    """The generation could not run or was cut off; `error` says why."""

    error: Exception


Event = Delta | Finished | Failed


@dataclass
class Job:
    """A generation request queued on a ServingThread."""

    prompt_ids: list[int]
    on_event: Callable[[Event], None]
    max_tokens: int = DEFAULT_MAX_TOKENS
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: Sequence[str] = ()
    time_limit_s: float = math.inf  # from submission, queueing included
    stats: GenerationStats = field(default_factory=GenerationStats)
    prefill_chunk: int | None = None  # tokens per prefill step (None: the scheduler's)
    snapshot_every: int | None = None  # tokens between state snapshots (None: the scheduler's)
    eos_token_ids: frozenset[int] | None = None  # None: the model's
    use_cache: bool = True  # False: neither reuse nor keep prefixes
    warm: bool = False  # prefill only, and keep the prompt's state in the prefix cache and its store (Model.warm)
    constraint: Constraint | None = None  # structured output: only tokens its grammar allows are drawn
    keep_special_tokens: bool = False  # text keeps special tokens (tool-call and reasoning markup to parse)
    speculate: str = "off"  # speculative decoding: "auto", "off", "lookup" or "draft" (engine/speculation.py)
    images: PromptImages | None = None  # the prompt's images, at their tokens' places
    adapter: Chosen = NO_ADAPTER  # the fine-tune it runs with (adapters/rows.py)
    submitted_at: float = 0.0
    _cancelled: threading.Event = field(default_factory=threading.Event, repr=False)

    def __post_init__(self) -> None:
        self.stop = check_stops(self.stop)

    @cached_property
    def cache_ids(self) -> list[int]:
        """What the prefix cache keys this prompt by: its ids, each image's tokens named by the image's content, all
        of them named by its adapter's where it has one."""
        ids = self.prompt_ids if self.images is None else self.images.cache_ids(self.prompt_ids)
        return self.adapter.keyed(ids)

    @property
    def reserved_tokens(self) -> int:
        """Positions this request may occupy in the KV cache at its end."""
        return len(self.prompt_ids) + self.max_tokens

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """Stop generating (the client went away); the scheduler frees the slot at its next step.

        Call it through `ServingThread.cancel`, which also wakes an idle scheduler."""
        self._cancelled.set()

    def stamp(self) -> None:
        """The job's clock starts now (queueing counts toward its time limit and its stats)."""
        self.submitted_at = time.perf_counter()

    def expired(self, now: float) -> bool:
        return now - self.submitted_at > self.time_limit_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.submitted_at
