"""Speculative decoding: sampled output keeps the target's distribution, auto's policy, the drafters, grammar masks.

Distributions are checked with Pearson's chi-square over thousands of fixed seeds
(deterministic: a run either passes or fails, never flakes). The expected
probabilities come from transformers' logits processors (the reference for what
temperature, top-k, top-p and the repetition penalty mean) applied to the same
logits, or to the tiny model's own logits from one plain forward pass; a
deliberately wrong verifier run through the same check proves it has the power
to fail.
"""

from __future__ import annotations

import shutil
import time
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import mlxinfer
from mlxinfer.engine.drafting import Draft, DraftModel, PromptLookup
from mlxinfer.engine.sampling import Sampler, SamplingParams
from mlxinfer.engine.speculation import (
    DRAFT_SLOWER,
    MARGIN,
    MAX_K,
    OFF_SEEDED,
    OFF_SLOWER,
    PROBE_K,
    VERIFY_SAMPLES,
    Speculation,
    StepCosts,
    speculation_for,
)
from mlxinfer.engine.stats import GenerationStats
from mlxinfer.engine.structure import structure_of
from mlxinfer.grammar import allowed_tokens, draft_masks
from tests.conftest import TINY

ALPHA = 1e-3  # a test fails below this p-value; the seeds are fixed, so it cannot flake
SEEDS = range(4000)


# ---- the reference: what the target's distribution is, and whether samples follow it ----


def reference_scores(
    logits: np.ndarray,
    params: SamplingParams,
    seen: Sequence[int] = (),
    allowed: np.ndarray | None = None,
) -> torch.Tensor:
    """One position's logits as transformers processes them: the repetition penalty over `seen`, the grammar's
    `allowed` mask, then (sampling) temperature, top-k and top-p."""
    scores = torch.tensor(np.asarray(logits, dtype=np.float64))[None]
    ids = torch.tensor([list(seen)], dtype=torch.long)
    if params.repetition_penalty != 1.0 and len(seen):
        scores = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(ids, scores)
    if allowed is not None:
        scores = scores.masked_fill(~torch.tensor(allowed)[None], -torch.inf)
    if params.is_greedy:
        return scores[0]
    scores = TemperatureLogitsWarper(params.temperature)(ids, scores)
    if params.top_k:
        scores = TopKLogitsWarper(params.top_k)(ids, scores)
    if params.top_p < 1.0:
        scores = TopPLogitsWarper(params.top_p)(ids, scores)
    return scores[0]


def reference_probs(
    logits: np.ndarray, params: SamplingParams, seen: Sequence[int] = (), allowed: np.ndarray | None = None
) -> np.ndarray:
    return torch.softmax(reference_scores(logits, params, seen, allowed), dim=-1).numpy()


def chi_square_p(observed: Counter, probs: dict[Hashable, float]) -> float:
    """Pearson's chi-square p-value of `observed` counts against `probs`; 0 if a count falls where p is 0.

    Categories expected fewer than 5 times are pooled (smallest first), as the test's approximation needs."""
    if any(probs.get(key, 0.0) <= 0.0 for key in observed):
        return 0.0
    total = sum(observed.values())
    bins, got, want = [], 0.0, 0.0
    for key in sorted((k for k in probs if probs[k] > 0), key=probs.get):
        got, want = got + observed.get(key, 0), want + total * probs[key]
        if want >= 5:
            bins.append((got, want))
            got, want = 0.0, 0.0
    if want and bins:
        bins[-1] = (bins[-1][0] + got, bins[-1][1] + want)
    if len(bins) < 2:
        return 1.0
    statistic = sum((o - e) ** 2 / e for o, e in bins)
    dof = len(bins) - 1
    # The chi-square survival function is the regularized upper incomplete gamma Q(dof / 2, statistic / 2).
    half = torch.tensor([dof / 2, statistic / 2], dtype=torch.float64)
    return float(torch.special.gammaincc(half[0], half[1]))


def test_the_chi_square_p_value_matches_the_published_table():
    """The 0.1% critical values of the chi-square distribution (NIST/SEMATECH table) give p = 0.001."""
    for dof, critical in [(1, 10.828), (4, 18.467), (10, 29.588)]:
        probs = {i: 1 / (dof + 1) for i in range(dof + 1)}
        n = 100_000  # counts chosen so that the statistic equals `critical`: all deviation in the first two bins
        e = n / (dof + 1)
        d = (critical * e / 2) ** 0.5
        observed = Counter({i: e for i in range(dof + 1)})
        observed[0], observed[1] = e + d, e - d
        assert chi_square_p(observed, probs) == pytest.approx(0.001, rel=2e-3)


def positions_p_values(
    emitted: Sequence[list[int]], drafts: Sequence[list[int]], probs: Sequence[np.ndarray], least: int = 300
) -> list[float]:
    """For each position j with at least `least` samples: the p-value of token j among the runs that emitted
    drafts[:j] first (each emitted token must follow the target's distribution given the ones before it)."""
    p_values = []
    for j, row in enumerate(probs):
        tokens = Counter(out[j] for out, d in zip(emitted, drafts) if len(out) > j and out[:j] == d[:j])
        if sum(tokens.values()) >= least:
            p_values.append(chi_square_p(tokens, dict(enumerate(row.tolist()))))
    return p_values


# ---- 1a. Sampler.verify against synthetic logits ----

VOCAB = 8


def synthetic_logits(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(scale=1.5, size=(rows, VOCAB)).astype(np.float32)


def draft_distribution(logits: np.ndarray, seed: int = 1) -> np.ndarray:
    """A draft model's q: near the target's unfiltered distribution, but not equal, and never zero."""
    noisy = logits + np.random.default_rng(seed).normal(scale=1.0, size=logits.shape)
    q = np.exp(noisy - noisy.max(axis=-1, keepdims=True))
    return (q / q.sum(axis=-1, keepdims=True)).astype(np.float32)


CASES = {
    # name: (params, drafted from q?, prompt seen, grammar masks?)
    "lookup": (SamplingParams(temperature=1.0), False, (), False),
    "lookup_filtered": (SamplingParams(temperature=0.7, top_k=5, top_p=0.9), False, (), False),
    "draft_model": (SamplingParams(temperature=1.0, top_k=6), True, (), False),
    "penalty_and_grammar": (SamplingParams(temperature=0.9, repetition_penalty=1.8), False, (1, 4), True),
}


class Setup:
    """One case: target logits for 2 drafts, the reference distribution of each row, and how drafts are made."""

    def __init__(self, name: str):
        self.params, self.from_q, self.seen, masked = CASES[name]
        self.logits = synthetic_logits(3)
        self.allowed = None
        if masked:  # the grammar forbids a likely token at row 0 and another at row 2
            self.allowed = np.ones((3, VOCAB), dtype=np.bool_)
            self.allowed[0, int(np.argmax(self.logits[0]))] = self.allowed[2, 6] = False
        self.q = draft_distribution(self.logits)
        self._q_drafts = [self._draw_drafts(seed) for seed in SEEDS] if self.from_q else []
        self._probs: dict[tuple[int, ...], list[np.ndarray]] = {}
        # Lookup's drafts: a likely first token and the likeliest after it (the filtered case: one outside
        # top-k/top-p, which must always be rejected).
        first = np.argsort(self.probs([0])[0])
        self.lookup = [int(first[-1 if name == "lookup_filtered" else -2])]
        after = self.probs(self.lookup)[1]
        self.lookup.append(int(np.flatnonzero(after == 0)[0] if name == "lookup_filtered" else np.argmax(after)))

    def probs(self, drafts: Sequence[int]) -> list[np.ndarray]:
        """The target's distribution at each row (row i has seen the prompt and drafts[:i])."""
        key = tuple(drafts)
        if key not in self._probs:
            masks = self.allowed if self.allowed is not None else [None] * 3
            seen = [(*self.seen, *drafts[:i]) for i in range(3)]
            self._probs[key] = [reference_probs(self.logits[i], self.params, seen[i], masks[i]) for i in range(3)]
        return self._probs[key]

    def drafts(self, seed: int) -> list[int]:
        return self._q_drafts[seed] if self.from_q else self.lookup

    def _draw_drafts(self, seed: int) -> list[int]:
        rng = np.random.default_rng(seed)
        return [int(rng.choice(VOCAB, p=row / row.sum())) for row in self.q[:2]]

    def verify(self, seed: int) -> list[int]:
        sampler = Sampler(SamplingParams(**{**vars(self.params), "seed": seed}), VOCAB)
        sampler.observe(mx.array(self.seen, dtype=mx.uint32))
        q = mx.array(self.q[:2]) if self.from_q else None
        allowed = None if self.allowed is None else mx.array(self.allowed)
        return sampler.verify(mx.array(self.logits), self.drafts(seed), q, allowed)

    def p_values(self, emitted: Sequence[list[int]]) -> list[float]:
        """`emitted[seed]`: the tokens verifying that seed's drafts gave."""
        drafts = [self.drafts(seed) for seed in SEEDS]
        # With fixed logits every row's distribution is the same whichever drafts came first (no penalty on q cases).
        return positions_p_values(emitted, drafts, self.probs(self.lookup))


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_verified_tokens_follow_the_targets_distribution(name):
    setup = Setup(name)
    emitted = [setup.verify(seed) for seed in SEEDS]
    for seed, out in zip(SEEDS, emitted):  # the drafts kept, then one of the target's own
        drafts = setup.drafts(seed)
        assert 1 <= len(out) <= len(drafts) + 1 and out[:-1] == drafts[: len(out) - 1]
    p_values = setup.p_values(emitted)
    assert len(p_values) >= 2, "the first and the second token must both be checked"
    assert min(p_values) > ALPHA, p_values


def accept_always(setup: Setup) -> Callable[[int], list[int]]:
    """A broken verifier: keeps every draft, then draws from the last row."""

    def verify(seed: int) -> list[int]:
        drafts = setup.drafts(seed)
        last = setup.probs(drafts)[len(drafts)]
        return [*drafts, int(np.random.default_rng(seed).choice(VOCAB, p=last))]

    return verify


def resample_from_p(setup: Setup) -> Callable[[int], list[int]]:
    """A subtly broken verifier: accepts with min(1, p/q) but draws a rejected position's token from p itself
    instead of the residual max(p - q, 0)."""

    def verify(seed: int) -> list[int]:
        rng, drafts, out = np.random.default_rng(10**6 + seed), setup.drafts(seed), []
        probs = setup.probs(drafts)
        for i, token in enumerate(drafts):
            q = setup.q[i][token] if setup.from_q else 1.0
            if rng.uniform() * q >= probs[i][token]:
                return [*out, int(rng.choice(VOCAB, p=probs[i]))]
            out.append(token)
        return [*out, int(rng.choice(VOCAB, p=probs[len(drafts)]))]

    return verify


@pytest.mark.parametrize("name", ["lookup", "draft_model"])
@pytest.mark.parametrize("broken", [accept_always, resample_from_p])
def test_the_distribution_check_fails_a_biased_verifier(name, broken):
    setup = Setup(name)
    verify = broken(setup)
    assert min(setup.p_values([verify(seed) for seed in SEEDS]), default=1.0) < ALPHA


# ---- 1b. End to end on a tiny model: the first tokens against the model's own probabilities ----

# A prompt whose likeliest first token (214) occurred before, after the same token (96): prompt lookup then drafts
# what followed it there (115), which the target keeps about a third of the time.
LOOKUP_PROMPT = [96, 214, 115, 96, 249, 31, 96, 120, 32, 96, 223, 33, 96, 151, 34, 96, 141, 35, 96]
E2E_OPTIONS = {"temperature": 1.0, "top_k": 3}  # three tokens a position: 27 sequences of three
E2E = SamplingParams(**E2E_OPTIONS)
E2E_SEEDS = range(600)


def sequence_probs(model: mlxinfer.Model, prompt: list[int], length: int) -> dict[tuple[int, ...], float]:
    """The chance of every sequence of `length` tokens (or fewer, ending at EOS), from plain forward passes."""
    found: dict[tuple[int, ...], float] = {}

    def walk(drawn: tuple[int, ...], chance: float) -> None:
        if len(drawn) == length or (drawn and drawn[-1] in model.eos_token_ids):
            found[drawn] = chance
            return
        row = reference_probs(model.logits(prompt + list(drawn))[-1], E2E)
        for token in np.flatnonzero(row):
            walk((*drawn, int(token)), chance * float(row[token]))

    walk((), 1.0)
    return found


@pytest.fixture(scope="module")
def near_draft(tmp_path_factory: pytest.TempPathFactory):
    """llama_classic with its final norm scaled at random: a draft model near the target, not equal to it."""
    folder = tmp_path_factory.mktemp("near-draft") / "llama_classic"
    shutil.copytree(TINY / "llama_classic", folder)
    weights = mx.load(str(folder / "model.safetensors"))
    scale = np.exp(0.3 * np.random.default_rng(0).normal(size=weights["model.norm.weight"].shape))
    weights["model.norm.weight"] = weights["model.norm.weight"] * mx.array(scale.astype(np.float32))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "pt"})
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("speculate", ["lookup", "draft"])
def test_sampled_speculation_keeps_the_models_distribution(speculate, near_draft):
    model = mlxinfer.load(TINY / "llama_classic", draft_model=near_draft)
    expected = sequence_probs(model, LOOKUP_PROMPT, 3)
    observed, drafted, accepted = Counter(), 0, 0
    for seed in E2E_SEEDS:
        result = model.generate(LOOKUP_PROMPT, max_tokens=3, speculate=speculate, seed=seed, **E2E_OPTIONS)
        observed[tuple(result.token_ids)] += 1
        drafted, accepted = drafted + result.stats.drafted_tokens, accepted + result.stats.accepted_tokens
    # Both outcomes of a verification happened often: drafts kept and drafts replaced.
    assert drafted >= len(E2E_SEEDS) / 3 and 0.15 * drafted < accepted < 0.85 * drafted, (drafted, accepted)
    assert chi_square_p(observed, expected) > ALPHA


# ---- 1c. Greedy verification with a repetition penalty and a grammar mask ----


def test_greedy_verify_penalizes_drafts_as_seen_and_respects_the_grammar():
    params = SamplingParams(repetition_penalty=2.0)
    prompt = [7]
    logits = np.full((5, VOCAB), -0.5, dtype=np.float32)
    logits[0, [2, 7]] = 3.0, 5.0  # 7 was in the prompt: 2.5 < 3.0
    logits[1, [2, 3]] = 4.0, 3.0  # 2 is the draft before: 2.0 < 3.0
    logits[2, [3, 5]] = 5.0, 2.6  # 3 likewise: 2.5 < 2.6
    logits[3, [6, 4]] = 9.0, 1.5  # the grammar forbids 6 here
    logits[4, 0] = 1.0
    allowed = np.ones((5, VOCAB), dtype=np.bool_)
    allowed[3, 6] = False
    drafts = [2, 3, 5, 6]

    def greedy(seen_drafts: bool) -> list[int]:
        out = []
        for i, draft in enumerate([*drafts, None]):
            seen = [*prompt, *drafts[:i]] if seen_drafts else prompt
            best = int(torch.argmax(reference_scores(logits[i], params, seen, allowed[i])))
            out.append(best)
            if best != draft:
                return out
        return out

    expected = greedy(seen_drafts=True)
    assert expected == [2, 3, 5, 4]
    assert greedy(seen_drafts=False) != expected  # the case tells the two apart
    sampler = Sampler(params, VOCAB)
    sampler.observe(mx.array(prompt, dtype=mx.uint32))
    assert sampler.verify(mx.array(logits), drafts, None, mx.array(allowed)) == expected
    # Rows are independent of each other: every prefix of the drafts gives the prefix of the answer.
    for n in range(len(drafts)):
        out = sampler.verify(mx.array(logits[: n + 1]), drafts[:n], None, mx.array(allowed[: n + 1]))
        assert out == expected[: n + 1]


# ---- 2. The auto policy ----


class FakeDrafter:
    """Proposes k copies of one token, taking `seconds_per_token` to do it."""

    def __init__(self, seconds_per_token: float = 0.0):
        self.seconds_per_token = seconds_per_token
        self.kept: list[int] = []

    def propose(self, drawn: Sequence[int], k: int) -> Draft:
        return Draft([7] * k, None, k * self.seconds_per_token)

    def accepted(self, n: int) -> None:
        self.kept.append(n)


def costs(plain_s: float, verify_s: float, verify_positions: int = 5) -> StepCosts:
    learned = StepCosts()
    learned.add(1, plain_s, verified=False)
    for _ in range(VERIFY_SAMPLES):  # a first verification alone is not trusted
        learned.add(verify_positions, verify_s, verified=True)
    return learned


def run_auto(speculation: Speculation, tokens: int, keep: Callable[[int], int]) -> list[tuple[int, int]]:
    """Decode `tokens` tokens as the loop does; (tokens generated before, drafts) for every step that drafted.
    `keep(k)`: how many of k drafts the target keeps."""
    stats, drafted = speculation.stats, []
    while stats.generated_tokens < tokens:
        draft = speculation.draft([], room=10**6) if speculation.active else None
        if draft is None:
            speculation.stepped(1)
            stats.generated_tokens += 1
            continue
        drafted.append((stats.generated_tokens, len(draft.tokens)))
        kept = keep(len(draft.tokens))
        speculation.stepped(kept + 1, len(draft.tokens))
        stats.generated_tokens += kept + 1
    return drafted


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens one verification of k drafts yields (Leviathan et al. 2023, eq. 1)."""
    return (1 - acceptance ** (k + 1)) / (1 - acceptance)


def test_step_costs_predict_a_line_through_the_mean_plain_and_verify_passes():
    learned = StepCosts()
    assert learned.predict(1) is None
    for seconds in (0.010, 0.012, 0.014):
        learned.add(1, seconds, verified=False)
    assert learned.predict(1) is None  # no verification timed yet
    learned.add(5, 0.050, verified=True)
    assert learned.predict(1) is None  # one is not enough: the first of a shape may carry one-off costs
    learned.add(9, 0.090, verified=True)
    # Means: plain (1, 0.012), verify (7, 0.070); the line through them.
    slope = (0.070 - 0.012) / (7 - 1)
    for positions in (1, 4, 13):
        assert learned.predict(positions) == pytest.approx(0.012 + slope * (positions - 1))
    # Timing noise that makes a verification look cheaper than a plain step never predicts a negative cost.
    assert costs(0.02, 0.01).predict(1) == costs(0.02, 0.01).predict(9) == pytest.approx(0.02)
    # Verifications that fed no more positions than plain steps give no slope: assume cost in proportion.
    assert StepCosts(plain=costs(0.01, 0.05).plain, verify=costs(0.01, 0.05, 1).verify).predict(3) == pytest.approx(
        3 * 0.05
    )


def test_recent_step_times_weigh_more():
    learned = costs(0.01, 0.05)
    for _ in range(20):
        learned.add(1, 0.02, verified=False)
    assert learned.predict(1) > 0.019  # the new cost, not the mean of all 21 (0.0195)


def test_auto_does_not_speculate_when_verifying_costs_linear_in_positions():
    """The CPU case: verifying k drafts costs k + 1 plain steps, so no acceptance short of 100% pays."""
    stats = GenerationStats()
    speculation = Speculation(FakeDrafter(), auto=True, stats=stats, costs=costs(0.2, 1.0))
    drafted = run_auto(speculation, 3100, keep=lambda k: k // 2)
    assert stats.speculation_off == OFF_SLOWER and stats.speculation_switched_off == 1
    # It switches off at once (no draft), probes with PROBE_K drafts after 64 plain tokens, then 128, 256, ...,
    # at most 1,024 apart.
    assert all(k == PROBE_K for _, k in drafted)
    starts = [at for at, _ in drafted]
    assert [b - a for a, b in zip(starts, starts[1:])] == [128, 256, 512, 1024, 1024]
    assert 64 <= starts[0] <= 66
    assert stats.drafted_tokens == PROBE_K * len(drafted)


def test_auto_speculates_when_verifying_is_nearly_flat():
    """The GPU case: verifying five positions costs 5% more than one."""
    plain_s, verify_s = 0.010, 0.0105
    stats = GenerationStats()
    speculation = Speculation(FakeDrafter(), auto=True, stats=stats, costs=costs(plain_s, verify_s))
    slope = (verify_s - plain_s) / 4
    acceptance = 0.5  # a draft kept, one not: the prior before any verification
    best = max(range(1, MAX_K + 1), key=lambda k: expected_tokens(acceptance, k) / (plain_s + slope * k))
    assert len(speculation.draft([], room=100).tokens) == best
    speculation.stepped(1 + best // 2, best)
    drafted = run_auto(speculation, 500, keep=lambda k: k)
    assert len(drafted) == speculation.stats.target_steps - 1  # every step drafted
    assert stats.speculation_off == "" and stats.speculation_switched_off == 0


def test_a_slow_drafter_turns_auto_off_even_when_verifying_is_flat():
    stats = GenerationStats()
    drafter = FakeDrafter(seconds_per_token=0.010)  # as slow as a target step
    speculation = Speculation(drafter, auto=True, stats=stats, costs=costs(0.010, 0.0105))
    run_auto(speculation, 200, keep=lambda k: k // 2)
    assert stats.speculation_off == OFF_SLOWER and stats.drafted_tokens < 20


def test_auto_counts_each_time_it_switches_speculation_off():
    stats = GenerationStats()
    flat, linear = costs(0.010, 0.0105), costs(0.2, 1.0)
    speculation = Speculation(FakeDrafter(), auto=True, stats=stats, costs=flat)
    run_auto(speculation, 50, keep=lambda k: k // 2)
    assert stats.speculation_off == "" and stats.speculation_switched_off == 0
    speculation.costs = linear
    run_auto(speculation, 100, keep=lambda k: k // 2)
    assert stats.speculation_off == OFF_SLOWER and stats.speculation_switched_off == 1
    speculation.costs = flat  # the next probe finds it pays again
    run_auto(speculation, 400, keep=lambda k: k // 2)
    assert stats.speculation_off == ""
    speculation.costs = linear
    run_auto(speculation, 500, keep=lambda k: k // 2)
    assert stats.speculation_off == OFF_SLOWER and stats.speculation_switched_off == 2


def test_auto_leaves_a_seeded_sampled_request_plain():
    target = SimpleNamespace(verified=True)
    seeded = SamplingParams(temperature=0.8, seed=3)

    def made(mode: str, params: SamplingParams) -> tuple[Speculation | None, GenerationStats]:
        stats = GenerationStats()
        return speculation_for(mode, target, None, [1, 2, 3], params, VOCAB, stats, StepCosts()), stats

    speculation, stats = made("auto", seeded)
    assert speculation is None and stats.speculation_off == OFF_SEEDED and stats.speculation == ""
    assert made("auto", SamplingParams(seed=3))[0] is not None  # greedy stays reproducible either way
    assert made("auto", SamplingParams(temperature=0.8))[0] is not None
    assert made("lookup", seeded)[0] is not None  # asked for explicitly


def test_a_seeded_sampled_generation_under_auto_drafts_nothing():
    model = mlxinfer.load(TINY / "llama_classic", draft_model=TINY / "llama_classic", speculate="auto")
    result = model.generate(LOOKUP_PROMPT, max_tokens=20, temperature=0.8, seed=3)
    assert result.stats.speculation_off == OFF_SEEDED and result.stats.drafted_tokens == 0
    assert result.token_ids == model.generate(LOOKUP_PROMPT, max_tokens=20, temperature=0.8, seed=3,
                                              speculate="off").token_ids  # fmt: skip


# A draft model that never agrees with the target (another tiny family, sharing the tokenizer): speculating only
# adds the draft model's passes.
DISAGREEING_DRAFT = "qwen3"
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


def unprofitable_run(model: mlxinfer.Model, tokens: int) -> mlxinfer.GenerationResult:
    result = model.generate(PROMPT, max_tokens=tokens, speculate="auto")
    assert result.stats.speculation == "draft" and result.stats.accepted_tokens == 0  # the case is as built
    assert result.token_ids == model.generate(PROMPT, max_tokens=tokens, speculate="off").token_ids
    return result


def test_auto_switches_speculation_off_on_a_case_built_to_be_unprofitable():
    model = mlxinfer.load(TINY / "llama_classic", draft_model=TINY / DISAGREEING_DRAFT, speculate="auto")
    stats = unprofitable_run(model, 200).stats
    # It may try again while its estimate of the acceptance still leans on the prior, then stays off.
    assert stats.speculation_off == OFF_SLOWER and 1 <= stats.speculation_switched_off <= 3
    assert stats.drafted_tokens <= 20


@pytest.mark.slow
def test_auto_stays_off_once_the_models_step_costs_are_known():
    model = mlxinfer.load(TINY / "llama_classic", draft_model=TINY / DISAGREEING_DRAFT, speculate="auto")
    unprofitable_run(model, 100)  # teaches the model's step costs and what the draft model's tokens cost
    (fixed, per_position), draft_s = model._step_costs.line(), model._step_costs.draft_token_s()
    # By hand: the best expected speedup of k drafts were 90% of them kept (auto's hope for an untried request).
    hopeful = (fixed + per_position) * max(
        sum(0.9**i for i in range(k + 1)) / (fixed + per_position * (k + 1) + k * draft_s) for k in range(1, 13)
    )
    result = model.generate(PROMPT, max_tokens=300, speculate="auto")
    stats = result.stats
    assert result.token_ids == model.generate(PROMPT, max_tokens=300, speculate="off").token_ids
    if hopeful < MARGIN:  # (as on a CPU, where a draft model the target's size costs what the target does)
        assert stats.speculation == "lookup" and stats.draft_declined == DRAFT_SLOWER
        assert model.runtime.draft.prefix_cache.stats.lookups == 1  # only the first run's draft model read
    else:
        assert stats.speculation == "draft" and stats.accepted_tokens == 0
        # Step times are measured on a shared machine: a noisy probe may turn it on once more, briefly.
        assert stats.speculation_off == OFF_SLOWER and 1 <= stats.speculation_switched_off <= 2
    # A first guess or two, then PROBE_K drafts at each probe (64 and 192 tokens after switching off).
    assert stats.drafted_tokens <= 2 * MAX_K + 3 * PROBE_K


# ---- 3. The drafters ----


def test_prompt_lookup_drafts_what_followed_the_latest_earlier_occurrence():
    # [5, 1, 2, 3] occurs twice before the end (followed by 10 then by 30); [2, 3] last occurred before 20.
    prompt = [5, 1, 2, 3, 10, 11, 5, 1, 2, 3, 30, 31, 8, 2, 3, 20, 21, 5, 1, 2, 3]
    assert PromptLookup(prompt).propose([], 4).tokens == [30, 31, 8, 2]  # the longest n-gram, latest occurrence
    assert PromptLookup([9, 2, 3, 20, 21, 6, 2, 3]).propose([], 3).tokens == [20, 21, 6]  # only [2, 3] matches
    assert PromptLookup([7, 8, 7, 8, 7, 8]).propose([], 5).tokens == [7, 8]  # up to the end of what is known
    assert PromptLookup(list(range(40))).propose([], 4).tokens == []  # nothing repeats
    lookup = PromptLookup([1, 2, 3, 4, 5])
    assert lookup.propose([6], 3).tokens == []
    assert lookup.propose([6, 1, 2], 4).tokens == [3, 4, 5, 6]  # drawn tokens count as text too


def test_prompt_lookup_indexes_a_long_context_once():
    prompt = np.random.default_rng(0).integers(0, 1000, size=50_000).tolist()
    lookup = PromptLookup(prompt)
    started = time.perf_counter()
    lookup.propose([], 8)
    first_s = time.perf_counter() - started
    later_s = []
    for drawn in ([3], [3, 4], [3, 4, 5]):
        started = time.perf_counter()
        lookup.propose(drawn, 8)
        later_s.append(time.perf_counter() - started)
    assert min(later_s) < first_s / 50, (first_s, later_s)


@pytest.mark.parametrize("name", ["llama_classic", "gemma2", "qwen3_5"])  # cuttable, windowed, recurrent
@pytest.mark.parametrize("kept", [0, 2, 4])
def test_a_draft_model_rewinds_to_the_drafts_the_target_kept(name, kept):
    model = mlxinfer.load(TINY / name, dtype="float32")
    lm, vocab, greedy = model._loaded.model, model.config.vocab_size, SamplingParams()
    prompt = list(range(3, 20))  # longer than gemma2's window of 8

    def after_first_step() -> tuple[DraftModel, list[int]]:
        drafter = DraftModel(lm, prompt, greedy, vocab)
        drafts = drafter.propose([40], 4).tokens
        drafter.accepted(kept)
        target_own = (drafts[kept] + 1) % 256 if kept < 4 else 77
        return drafter, [40, *drafts[:kept], target_own]

    drafter, drawn = after_first_step()
    fresh = DraftModel(lm, prompt, greedy, vocab)
    assert drafter.propose(drawn, 3).tokens == fresh.propose(drawn, 3).tokens
    # Its cache holds a prefix of the sequence: feeding the rest gives the logits of one plain forward pass.
    drafter, drawn = after_first_step()
    sequence = prompt + drawn
    assert drafter.fed <= len(prompt) + 1 + kept
    rest = mx.array([sequence[drafter.fed :]], dtype=mx.uint32)
    logits = np.array(lm(rest, drafter.cache)[0, -1].astype(mx.float32))
    np.testing.assert_allclose(logits, model.logits(sequence)[-1], atol=1e-4)


# ---- 4. Grammar masks for drafts ----


def test_draft_masks_match_a_fresh_constraint_step_by_step(tiny_llama):
    vocab, eos = tiny_llama.config.vocab_size, tiny_llama.eos_token_ids
    structure = structure_of(regex="[ab]{2,4}c")

    def fresh():
        return structure.constraint(tiny_llama.tokenizer, vocab, eos)

    def stepped(tokens: list[int]) -> list[np.ndarray]:
        constraint, masks = fresh(), []
        for token in [*tokens, None]:
            masks.append(np.array(allowed_tokens([constraint], vocab)[0]))
            if token is not None:
                constraint.advance(token)
        return masks

    a, b, c, x = (ord(ch) for ch in "abcx")
    for drafts, allowed in [([a, b, a, x], 3), ([a, b, c], 3), ([x, a], 0), ([a, c], 1), ([b, b, b, b, c], 5)]:
        constraint = fresh()
        count, masks = draft_masks(constraint, drafts, vocab)
        assert count == allowed
        assert np.array_equal(np.array(masks), np.stack(stepped(drafts[:allowed])))
        # The matcher ends where it began: it gives the start's mask, and takes a different path from there.
        assert np.array_equal(np.array(allowed_tokens([constraint], vocab)[0]), stepped([])[0])
        for token in (b, a, c):
            constraint.advance(token)
        assert np.array_equal(np.array(allowed_tokens([constraint], vocab)[0]), stepped([b, a, c])[-1])


def test_draft_masks_start_from_where_the_matcher_is(tiny_llama):
    vocab, eos = tiny_llama.config.vocab_size, tiny_llama.eos_token_ids
    structure = structure_of(regex="[ab]{2,4}c")
    a, b, c = (ord(ch) for ch in "abc")
    constraint = structure.constraint(tiny_llama.tokenizer, vocab, eos)
    constraint.advance(a)
    count, masks = draft_masks(constraint, [a, c, a], vocab)  # "a" then "ac": complete, nothing may follow "c"
    assert count == 2
    reference = structure.constraint(tiny_llama.tokenizer, vocab, eos)
    for token in (a, a, c):
        reference.advance(token)
    assert np.array_equal(np.array(masks[-1]), np.array(allowed_tokens([reference], vocab)[0]))
    assert np.flatnonzero(np.array(masks[-1])).tolist() == sorted(eos)
    for token in (b, c):  # still after the first "a": "abc" is complete too
        constraint.advance(token)
    assert np.flatnonzero(np.array(allowed_tokens([constraint], vocab)[0])).tolist() == sorted(eos)


def test_auto_goes_on_when_hundreds_of_verifications_keep_every_draft():
    """The acceptance estimate reaches exactly 1.0 in floating point after ~310 such steps; planning must not
    divide by 1 - acceptance (a ZeroDivisionError there would fail every row of the batch)."""
    stats = GenerationStats()
    speculation = Speculation(FakeDrafter(), auto=True, stats=stats, costs=costs(0.2, 0.21))
    drafted = run_auto(speculation, 400 * (MAX_K + 1), keep=lambda k: k)
    assert speculation.acceptance == 1.0 and len(drafted) > 350
    assert stats.speculation_off == "" and drafted[-1][1] == MAX_K
