"""One request's speculative decoding: its drafter, how many tokens to draft, and whether it pays.

`lookup` and `draft` always speculate; the number of drafts adapts to what the
target keeps (two more after a step that kept them all, one fewer otherwise).

`auto` decides from measurements, per step. What a forward pass of the target
costs for the positions it feeds is learned as the model runs (`StepCosts`,
shared by its requests): on a GPU, verifying five tokens costs little more than
decoding one (the weights are read once), while on a CPU backend whose matmul is
compute-bound it costs about five. With the share of drafts this request's target
kept so far (`acceptance`) and what a draft costs to make, it predicts tokens per
second for each number of drafts, and speculates only with the best of them and
only when that beats plain decoding. When it does not, it decodes plainly
(pipelined, as plain decoding runs) and probes again with two drafts after 64
tokens, then 128, ... (at most 1,024), so the estimate follows the text.

With a draft model loaded, auto uses it unless what it learned of this model
says a draft model cannot pay here even keeping 90% of its drafts: then it
drafts by prompt lookup, without making the draft model read the prompt (every
16th such request uses it anyway, to time it again). Nor does auto hold the
first token for a draft model that has not read what the target resumed from
its prefix cache: that request drafts by lookup, and the draft model keeps
what it read for the next.

Where prompt lookup finds nothing to draft, the next few steps decode plainly and
pipelined (a step that may verify drafts cannot be queued before the token it
drafts from is known), then it looks again.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field, replace

from ..errors import SamplingError
from ..models.decoder import DecoderLM
from ..untrusted import shown
from .drafting import Draft, DraftModel, DraftRuntime, PromptLookup
from .sampling import SamplingParams
from .stats import GenerationStats

log = logging.getLogger("mlxinfer.scheduler")

MODES = ("auto", "off", "lookup", "draft")
START_K, MAX_K, PROBE_K = 4, 12, 2  # drafted tokens per step: at first, at most, and when auto probes again
MARGIN = 1.05  # auto speculates only when it predicts at least 5% more tokens per second
RETRY_TOKENS, MAX_RETRY_TOKENS = 64, 1024  # plain tokens before auto probes again (doubled each time)
MEMORY = 0.9  # weight kept by older acceptance evidence at each verification
REST_STEPS = 4  # plain, pipelined steps after a step that found nothing to draft
VERIFY_SAMPLES = 2  # verifications timed before auto weighs speculating against plain decoding
HOPEFUL_ACCEPTANCE = 0.9  # what auto grants a draft model it has timed before deciding whether to load its prompt
RETRY_DRAFT_MODEL = 16  # auto still drafts with a draft model known too slow every this many requests (to re-time it)

OFF_SLOWER = "slower than plain decoding on this device"
OFF_SEEDED = "a seeded sampled request stays reproducible (ask for lookup or draft explicitly)"
OFF_UNVERIFIED = "an unverified model runs plain decoding only"
DRAFT_SLOWER = "even keeping 90% of its drafts it would be slower than plain decoding on this device"
DRAFT_UNREAD = "it had not read the prompt the model resumed from its prefix cache (what it read is kept for next time)"
DRAFT_IMAGES = "the prompt has images, which a draft model would read as text tokens"
REASONS = {OFF_SLOWER: "slower", OFF_SEEDED: "seeded", OFF_UNVERIFIED: "unverified"}  # short labels, for /metrics
# Why a request drafted by lookup instead of its draft model, for /metrics.
DRAFT_REASONS = {DRAFT_SLOWER: "slower", DRAFT_UNREAD: "unread", DRAFT_IMAGES: "images"}


def check_mode(mode: object, draft_model: object) -> str:
    """A SamplingError unless `mode` is one of MODES (and `draft` has a draft model: `draft_model` not None)."""
    if mode not in MODES:
        raise SamplingError(f"speculate must be one of {', '.join(MODES)}, got {shown(mode)}")
    if mode == "draft" and draft_model is None:
        raise SamplingError("speculate='draft' needs a draft model: load one with --draft-model / draft_model=")
    return mode


def check_startup_mode(mode: object, draft_model: object) -> str:
    """check_mode for a front end whose mode is set once, at start (the CLI, the server): a draft model given with
    a mode that never drafts with it is refused too, rather than loaded for nothing."""
    if draft_model is not None and mode in ("off", "lookup"):
        raise SamplingError(
            f"--speculate {mode} never drafts with the draft model {draft_model}; "
            "drop --draft-model, or use --speculate auto or draft"
        )
    return check_mode(mode, draft_model)


@dataclass
class _Mean:
    """A running mean of (positions, seconds) points, recent ones weighing more."""

    positions: float = 0.0
    seconds: float = 0.0
    count: int = 0

    def add(self, positions: int, seconds: float) -> None:
        weight = max(0.2, 1 / (self.count + 1))
        self.positions += weight * (positions - self.positions)
        self.seconds += weight * (seconds - self.seconds)
        self.count += 1


@dataclass
class StepCosts:
    """Seconds a decode forward pass of the target takes by the positions it feeds (rows x tokens per row):
    a line through the mean plain step and the mean verification, learned as the model runs."""

    plain: _Mean = field(default_factory=_Mean)
    verify: _Mean = field(default_factory=_Mean)
    drafted: _Mean = field(default_factory=_Mean)  # the draft model's: (tokens drafted, seconds) per proposal

    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # a Model's threads share it
    _draft_seen: bool = False  # the first proposal (one-off costs) is not timed
    _declined: int = 0  # auto requests that left the draft model out

    def add(self, positions: int, seconds: float, verified: bool) -> None:
        with self._lock:
            (self.verify if verified else self.plain).add(positions, seconds)

    def add_draft(self, tokens: int, seconds: float) -> None:
        with self._lock:
            if self._draft_seen:
                self.drafted.add(tokens, seconds)
            self._draft_seen = True

    def draft_token_s(self) -> float | None:
        """Seconds the draft model takes per drafted token; None until VERIFY_SAMPLES proposals were timed."""
        with self._lock:
            d = replace(self.drafted)
        return d.seconds / d.positions if d.count >= VERIFY_SAMPLES and d.positions else None

    def draft_model_pays(self) -> bool:
        """Whether a draft model could beat plain decoding, were most of its drafts kept (True until timed)."""
        line, draft_s = self.line(), self.draft_token_s()
        if line is None or draft_s is None:
            return True
        return best_drafts(line, 1, HOPEFUL_ACCEPTANCE, draft_s)[1] >= MARGIN

    def skips_draft_model(self, count: bool) -> bool:
        """Whether the next auto request leaves the draft model out: known too slow, but for every
        RETRY_DRAFT_MODEL-th such request, which drafts with it to time it again (the device's load changes).
        `count`: the request starts now (the memory plan only asks)."""
        if self.draft_model_pays():
            return False
        with self._lock:
            declined = self._declined + 1
            if count:
                self._declined = declined
        return declined % RETRY_DRAFT_MODEL != 0

    def predict(self, positions: int) -> float | None:
        """Seconds for a pass feeding `positions`; None until a plain pass and two verifications were timed
        (the first of a shape may carry one-off costs)."""
        line = self.line()
        return None if line is None else max(line[0] + line[1] * positions, 1e-6)

    def line(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per position) of a pass, or None as for `predict`."""
        with self._lock:
            p, v = replace(self.plain), replace(self.verify)
        if not p.count or v.count < VERIFY_SAMPLES:
            return None
        if v.positions > p.positions:
            slope = max(0.0, (v.seconds - p.seconds) / (v.positions - p.positions))
        else:  # verifications fed no more than plain steps (a lone row after a full batch): assume the worst,
            slope = max(p.seconds / p.positions, v.seconds / v.positions)  # cost in proportion to positions
        return max(0.0, p.seconds - slope * p.positions), slope


def best_drafts(line: tuple[float, float], rows: int, acceptance: float, draft_s: float) -> tuple[int, float]:
    """The number of drafts per row that maximizes expected tokens per second, and its speedup over a plain step.

    k drafts give 1 + a + ... + a^k tokens (each kept only if the one before was), for
    every row's drafting and one verification of rows x (k + 1) positions."""
    fixed, per_position = line
    plain = max(fixed + per_position * rows, 1e-6)
    best, k, expected = 0.0, 0, 1.0
    for drafts in range(1, MAX_K + 1):
        expected += acceptance**drafts
        seconds = max(fixed + per_position * rows * (drafts + 1) + rows * drafts * draft_s, 1e-6)
        if expected / seconds > best:
            best, k = expected / seconds, drafts
    return k, best * plain


class Speculation:
    """Drafting for one running sequence; the loop reports every step it takes back here."""

    def __init__(self, drafter: PromptLookup | DraftModel, auto: bool, stats: GenerationStats, costs: StepCosts):
        self.drafter, self.auto, self.stats, self.costs = drafter, auto, stats, costs
        self.k = START_K
        self._kept, self._missed = 1.0, 1.0  # acceptance evidence, from a prior of one of each
        # seconds to draft one token: the draft model's, as timed on this model so far; prompt lookup's are near 0
        self._draft_s = (costs.draft_token_s() or 0.0) if isinstance(drafter, DraftModel) else 0.0
        self._off = False  # auto found speculation slower
        self._probe_at, self._retry = 0, RETRY_TOKENS
        self._proposed: Draft | None = None
        self._rest = 0  # plain steps to take before drafting again

    @property
    def acceptance(self) -> float:
        """The chance the target keeps a draft, given it kept the one before (from recent verifications)."""
        return self._kept / (self._kept + self._missed)

    @property
    def active(self) -> bool:
        """Speculation is on for now (auto has not found it slower, or a probe is due)."""
        return not self._off or self.stats.generated_tokens >= self._probe_at

    @property
    def ready(self) -> bool:
        """The next step may verify drafts (so it cannot be pipelined): on, and not resting after a step that
        found nothing to draft (prompt lookup in a text that does not repeat itself)."""
        return self.active and not self._rest

    def draft(self, drawn: list[int], room: int, rows: int = 1) -> Draft | None:
        """Up to `room` tokens to check after `drawn` in a batch of `rows`, or None to step plainly."""
        k = min(self._plan(rows) if self.auto else self.k, room)
        if k < 1:
            return None
        draft = self.drafter.propose(drawn, k)
        self._proposed = draft
        if not draft.tokens:
            if isinstance(self.drafter, PromptLookup):  # (a draft model catching up on the prompt drafts next step)
                self._rest = REST_STEPS  # decode a few steps pipelined before looking again
            return None
        self._draft_s = draft.seconds / len(draft.tokens)
        if isinstance(self.drafter, DraftModel):
            self.costs.add_draft(len(draft.tokens), draft.seconds)
        return draft

    @property
    def uses_draft_model(self) -> bool:
        return isinstance(self.drafter, DraftModel)

    @property
    def draft_bytes(self) -> int:
        """Bytes the draft model's cache holds for this sequence (0 for prompt lookup)."""
        return sum(c.nbytes for c in self.drafter.cache) if isinstance(self.drafter, DraftModel) else 0

    def waits_for_draft_model(self) -> bool:
        """The target has read the prompt and the draft model has not (the target resumed more of it from its
        prefix cache): `draft` waits for it; auto keeps what it read for a later prompt and drafts this one by
        prompt lookup, so the first token does not wait."""
        if not self.auto or not isinstance(self.drafter, DraftModel):
            return True
        try:
            self.drafter.keep([])
        except Exception:  # noqa: BLE001 - a cache that cannot keep it must not fail the answer
            log.warning("could not keep the draft model's reading of a prompt", exc_info=True)
        self.drafter, self._draft_s = PromptLookup(self.drafter.context), 0.0
        self.stats.speculation, self.stats.draft_declined = "lookup", DRAFT_UNREAD
        return False

    def read_prompt(self, tokens: int) -> bool:
        """A draft model reads up to `tokens` more of the prompt (while the target prefills); whether some is
        left to read (never for prompt lookup, which reads nothing)."""
        if not isinstance(self.drafter, DraftModel):
            return False
        self.drafter.read(tokens)
        return self.drafter.unread > 0

    def keep(self, drawn: list[int]) -> None:
        """The sequence ended with `drawn`: a draft model offers what it read to its prefix cache."""
        if isinstance(self.drafter, DraftModel):
            self.drafter.keep(drawn)

    def _plan(self, rows: int) -> int:
        """How many tokens auto drafts now (0: none)."""
        if not self.costs.plain.count:
            return 0  # a plain step is timed first: the baseline every choice is weighed against
        line = self.costs.line()
        if line is None:
            return self.k  # no verification timed yet on this model: this one teaches the cost
        k, speedup = best_drafts(line, rows, self.acceptance, self._draft_s)
        if speedup >= MARGIN:
            self._off = False
            self.stats.speculation_off = ""
            return k
        probing = self._off  # off already, and a probe is due (else this sequence would not be active)
        if not self._off:
            self._off = True
            self.stats.speculation_off = OFF_SLOWER
            self.stats.speculation_switched_off += 1
        self._probe_at = self.stats.generated_tokens + self._retry
        self._retry = min(2 * self._retry, MAX_RETRY_TOKENS)
        return PROBE_K if probing else 0  # a probe: a cheap look at whether the text became easier to draft

    def stepped(self, tokens: int, checked: int | None = None) -> None:
        """This sequence's step emitted `tokens`; `checked` drafts were verified in it (None: a plain step)."""
        if self._proposed is not None:
            self.drafter.accepted(tokens - 1 if checked else 0)
            self._proposed = None
        self.stats.target_steps += 1
        if not checked:
            self._rest = max(0, self._rest - 1)
            return
        kept = tokens - 1
        self.stats.drafted_tokens += checked
        self.stats.accepted_tokens += kept
        self._kept = MEMORY * self._kept + kept
        self._missed = MEMORY * self._missed + (kept < checked)
        if self._off and kept == checked:
            self._probe_at = 0  # the probe kept everything: weigh speculating again at the next step
        self.k = min(self.k + 2, MAX_K) if kept == checked else max(1, self.k - 1)


def speculation_for(
    mode: str, target: DecoderLM, draft: DraftRuntime | None, prompt: list[int], params: SamplingParams,
    vocab: int, stats: GenerationStats, costs: StepCosts, images: bool = False,
) -> Speculation | None:  # fmt: skip
    """The speculation a request asked for (None: plain decoding; `stats` say why when auto declined, or why a
    prompt with `images` drafts by lookup: a draft model would read their tokens as text)."""
    if mode == "off":
        return None
    stats.speculation_off = _plain_reason(mode, target, params)
    if stats.speculation_off:
        return None
    use_model = uses_draft_model(mode, target, draft, params, costs, starting=True, images=images)
    if images and draft is not None and mode in ("auto", "draft"):
        stats.draft_declined = DRAFT_IMAGES
    elif mode == "auto" and draft is not None and not use_model:
        stats.draft_declined = DRAFT_SLOWER  # it would only cost its read of the prompt; lookup costs nothing
    drafter: DraftModel | PromptLookup = PromptLookup(prompt)
    if use_model:
        assert draft is not None
        drafter = DraftModel(draft.decoder, prompt, params, vocab, prefix=draft.prefix_cache)
    stats.speculation = "draft" if use_model else "lookup"
    return Speculation(drafter, auto=mode == "auto", stats=stats, costs=costs)


def uses_draft_model(
    mode: str, target: DecoderLM, draft: DraftRuntime | None, params: SamplingParams, costs: StepCosts,
    starting: bool = False, images: bool = False,
) -> bool:  # fmt: skip
    """Whether a request in `mode` drafts with the draft model (`starting`: it starts now; else the memory plan
    asks). Auto leaves out one known too slow to pay (see StepCosts.skips_draft_model); a prompt with `images`
    never does (a draft model reads text only)."""
    if draft is None or images or mode not in ("auto", "draft") or _plain_reason(mode, target, params):
        return False
    return mode == "draft" or not costs.skips_draft_model(count=starting)


def _plain_reason(mode: str, target: DecoderLM, params: SamplingParams) -> str:
    """Why a request in `mode` (not "off") decodes plainly, "" if it may speculate."""
    if not target.verified:
        return OFF_UNVERIFIED
    if mode == "auto" and not params.is_greedy and params.seed is not None:
        return OFF_SEEDED  # auto's timing-based choices would change a seeded answer run to run
    return ""
