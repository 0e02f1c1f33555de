"""One request's speculative decoding: its drafter, how many tokens to draft, and whether it still pays.

`lookup` and `draft` always speculate; `auto` times the request's own steps and
stops speculating when they come out slower than plain decoding. It first times
a few plain steps (pipelined, as plain decoding runs), then speculates for a
few steps (drafting, verification and rollback all counted, and plain steps
taken meanwhile for want of a draft, which cannot be pipelined). If tokens came
slower, it decodes plainly and tries again later, after twice as many tokens
each time. The number of drafted tokens adapts to what the target kept: two more
after a step that kept them all, one fewer after a rejection.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import SamplingError
from ..models.decoder import DecoderLM
from ..untrusted import shown
from .drafting import Draft, DraftModel, PromptLookup
from .stats import GenerationStats

MODES = ("auto", "off", "lookup", "draft")
START_K, MAX_K = 4, 12  # drafted tokens per step: the first, and the most
PROBE_STEPS = 4  # plain steps auto times before speculating
TRIAL_STEPS = 4  # speculative steps auto times before judging
WINDOW_STEPS = 16  # auto judges the latest steps, so it follows the text (a quote ends, a list starts)
RETRY_TOKENS, MAX_RETRY_TOKENS = 64, 1024  # plain tokens before auto tries again (doubled each time)

OFF_SLOWER = "slower than plain decoding"
OFF_SEEDED = "a seeded sampled request stays reproducible (ask for lookup or draft explicitly)"
OFF_UNVERIFIED = "an unverified model runs plain decoding only"


def check_mode(mode: object, draft_model: DecoderLM | None) -> str:
    """A SamplingError unless `mode` is one of MODES (and `draft` has a draft model)."""
    if mode not in MODES:
        raise SamplingError(f"speculate must be one of {', '.join(MODES)}, got {shown(mode)}")
    if mode == "draft" and draft_model is None:
        raise SamplingError("speculate='draft' needs a draft model: load one with --draft-model / draft_model=")
    return mode


@dataclass
class _Timing:
    """Seconds and tokens over recent steps of one kind."""

    seconds: float = 0.0
    tokens: int = 0
    steps: int = 0

    def add(self, seconds: float, tokens: int) -> None:
        if self.steps >= WINDOW_STEPS:  # keep roughly the latest window
            self.seconds, self.tokens, self.steps = self.seconds / 2, self.tokens // 2, self.steps // 2
        self.seconds, self.tokens, self.steps = self.seconds + seconds, self.tokens + tokens, self.steps + 1

    @property
    def per_token(self) -> float:
        return self.seconds / max(self.tokens, 1)


class Speculation:
    """Drafting for one running sequence; the loop reports every step it takes back here."""

    def __init__(self, drafter: PromptLookup | DraftModel, auto: bool, stats: GenerationStats):
        self.drafter, self.auto, self.stats = drafter, auto, stats
        self.k = START_K
        self._plain, self._trial = _Timing(), _Timing()
        self._resume_at = 0  # generated tokens after which auto tries again (0: not switched off)
        self._retry = RETRY_TOKENS
        self._proposed: Draft | None = None

    @property
    def active(self) -> bool:
        """The next step may speculate (so it cannot be pipelined)."""
        if not self.auto:
            return True
        if self._resume_at:
            if self.stats.generated_tokens < self._resume_at:
                return False
            self._resume_at, self._plain, self._trial = 0, _Timing(), _Timing()  # time both afresh
        return self._plain.steps >= PROBE_STEPS

    def draft(self, drawn: list[int], room: int) -> Draft | None:
        """Up to `room` tokens to check after `drawn`, or None to step plainly."""
        k = min(self.k, room)
        if k < 1 or not self.active:
            return None
        draft = self.drafter.propose(drawn, k)
        self._proposed = draft
        return draft if draft.tokens else None

    def stepped(self, seconds: float, tokens: int, checked: int | None = None) -> None:
        """A step of this sequence took `seconds` and emitted `tokens`; `checked` drafts were verified in it
        (None: a plain step)."""
        if self._proposed is not None:
            self.drafter.accepted(tokens - 1 if checked else 0)
            seconds -= self._proposed.setup_s
            self._proposed = None
        self.stats.target_steps += 1
        if checked:
            self.stats.drafted_tokens += checked
            self.stats.accepted_tokens += tokens - 1
            self.k = min(self.k + 2, MAX_K) if tokens - 1 == checked else max(1, self.k - 1)
        if not self.auto:
            return
        if not self.active:
            self._plain.add(seconds, tokens)
            return
        self._trial.add(seconds, tokens)
        if self._trial.steps >= TRIAL_STEPS and self._trial.per_token > self._plain.per_token:
            self._switch_off()

    def _switch_off(self) -> None:
        self.stats.speculation_off = OFF_SLOWER
        self.stats.speculation_switched_off += 1
        self._resume_at = self.stats.generated_tokens + self._retry
        self._retry = min(2 * self._retry, MAX_RETRY_TOKENS)


def speculation_for(
    mode: str, target: DecoderLM, draft_model: DecoderLM | None, prompt: list[int], params, vocab: int,
    stats: GenerationStats,
) -> Speculation | None:  # fmt: skip
    """The speculation a request asked for (None: plain decoding; `stats` say why when auto declined)."""
    if mode == "off":
        return None
    if not target.verified:
        stats.speculation_off = OFF_UNVERIFIED
        return None
    if mode == "auto" and not params.is_greedy and params.seed is not None:
        stats.speculation_off = OFF_SEEDED  # auto's timing-based choices would change a seeded answer run to run
        return None
    use_model = mode == "draft" or (mode == "auto" and draft_model is not None)
    drafter = DraftModel(draft_model, prompt, params, vocab) if use_model else PromptLookup(prompt)
    stats.speculation = "draft" if use_model else "lookup"
    return Speculation(drafter, auto=mode == "auto", stats=stats)
