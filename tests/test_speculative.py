"""Speculative decoding: the output is plain decoding's, and a rollback leaves every cache as a cold run's.

Expected values come from paths that never speculate: the same request with speculate="off" (run alone,
without the prefix cache), a cold prefill of exactly the tokens kept, and plain greedy decoding driven
one model call at a time.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from safetensors.numpy import load_file, save_file

import mlxinfer
from mlxinfer.cache import StateCache, make_cache
from mlxinfer.cache.batch import row_cache
from mlxinfer.cache.kv import STEP, QuantizedKVCache
from mlxinfer.engine import Delta, Failed, Finished, Job, SamplingParams
from mlxinfer.engine.batch import DecodeBatch, Running
from mlxinfer.engine.drafting import CATCH_UP_TOKENS, Draft, DraftModel
from mlxinfer.engine.sampling import Sampler
from mlxinfer.engine.speculation import MAX_K as MAX_DRAFTS
from mlxinfer.models.config import normalize_config
from mlxinfer.models.decoder import build_model
from mlxinfer.models.footprint import KV_GROUP_SIZE
from tests.conftest import ARCHITECTURES, TINY

BASES = [[40 + (i * step) % 23 for i in range(21)] for step in (5, 1, 7)]  # printable bytes
Z, COVERED = 32, range(33, 256, 3)  # drafting_prompt: a space before each of 75 byte tokens
MAX_TOKENS = 16
VOCAB = 272  # every tiny fixture's
DRAFT_NOISE = 0.5  # std of the noise on the draft's final norm: it agrees with the target on ~10-75% of tokens


# ---- models ----------------------------------------------------------------------------------------------------


def noisy_copy(source: Path, folder: Path, noise: float = DRAFT_NOISE) -> Path:
    """A draft that partly agrees with `source`: the same checkpoint with noise on its final norm's weight.

    Only the last hidden state changes, so the draft reads the same context as the target and disagrees
    only where the noise moves the top logit (no chaotic drift: acceptance stays partial in every family)."""
    shutil.copytree(source, folder, ignore=shutil.ignore_patterns("golden.safetensors"))
    weights = load_file(str(folder / "model.safetensors"))
    skip = (".layers.", "per_layer", "vision", "visual", "multi_modal")  # the text model's own final norm only
    final = [k for k in weights if k.endswith("norm.weight") and not any(part in k for part in skip)]
    assert len(final) == 1, final
    rng = np.random.default_rng(0)
    weights[final[0]] = weights[final[0]] + rng.normal(0, noise, weights[final[0]].shape).astype(np.float32)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def wide_heads(name: str, folder: Path, seed: int = 1) -> Path:
    """Fixture `name` with head_dim 64 (a quantized KV cache quantizes groups of 64 along it), random weights."""
    config = json.loads((TINY / name / "config.json").read_text()) | {"head_dim": KV_GROUP_SIZE}
    shutil.copytree(TINY / name, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(seed)
    params = tree_flatten(build_model(normalize_config(config)).parameters())  # mlx-lm's layout: loads as is
    weights = {k: rng.normal(0, 0.2, p.shape).astype(np.float32) for k, p in params}
    original = load_file(str(TINY / name / "model.safetensors"))
    for key in [k for k in weights if k.endswith("norm.weight") and k in original]:
        centre = np.round(original[key].mean())  # 1, or 0 where the norm scales by 1 + w: as the fixture's
        weights[key] = (centre + rng.normal(0, 0.1, weights[key].shape)).astype(np.float32)
    for key in [k for k in weights if k.endswith(("embed_tokens.weight", "lm_head.weight"))]:
        weights[key][256:] *= 0.01  # special tokens (EOS among them) stay unlikely: answers run their length
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """wide(name) -> the folder of wide_heads(name), written once for the module."""
    made: dict[str, Path] = {}

    def folder(name: str) -> Path:
        if name not in made:
            made[name] = wide_heads(name, tmp_path_factory.mktemp("wide") / name)
        return made[name]

    return folder


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """family(name) -> the tiny model `name` with its noisy draft, loaded once for the module."""
    loaded: dict[str, mlxinfer.Model] = {}

    def load(name: str) -> mlxinfer.Model:
        if name not in loaded:
            draft = noisy_copy(TINY / name, tmp_path_factory.mktemp("draft") / name)
            loaded[name] = mlxinfer.load(TINY / name, draft_model=draft, prefix_cache_bytes=0, speculate="off")
        return loaded[name]

    return load


def drafting_prompt(model: mlxinfer.Model) -> list[int]:
    """A prompt after which prompt lookup surely drafts: `Z x1 Z x2 ... Z`, where some `Z x` is followed by
    the token plain decoding draws first (then lookup proposes what followed that pair).

    That token is looked up with plain decoding; when it is not covered yet, `t Z` is appended and the
    search goes on (each round covers one more token; a handful of rounds suffice on every fixture)."""
    prompt = [t for x in COVERED for t in (Z, x)] + [Z]
    for _ in range(40):
        first = model.generate(prompt, max_tokens=1, speculate="off", use_cache=False).token_ids
        if first and (Z, first[0]) in set(zip(prompt, prompt[1:])):
            return prompt
        prompt += [*first, Z]  # (an answer that ends at once: another Z, and a new first token)
    raise AssertionError("no prompt found after which prompt lookup drafts")


def draft_agreement(model: mlxinfer.Model, prompt: list[int], answer: list[int]) -> list[bool]:
    """Whether the draft model's greedy pick, reading the target's own text, is the target's token, at each
    answer position after the first (which the prefill draws): one plain forward pass of the draft."""
    lm = model.draft.model
    logits = lm.head(lm.hidden(mx.array([prompt + answer], dtype=mx.uint32), make_cache(lm.cache_kinds)))[0]
    picks = mx.argmax(logits[len(prompt) : len(prompt) + len(answer) - 1], axis=-1).tolist()
    return [pick == token for pick, token in zip(picks, answer[1:])]


def speculative_runs(model: mlxinfer.Model) -> dict[str, mlxinfer.GenerationResult]:
    """{"plain", "lookup"} on drafting_prompt, and {"plain_base", "draft"} on a prompt where the noisy draft,
    reading plain decoding's answer, agrees at some positions and not at others (so a draft-model run keeps
    some drafts and takes some back)."""

    def run(ids: list[int], mode: str) -> mlxinfer.GenerationResult:
        return model.generate(ids, max_tokens=MAX_TOKENS, speculate=mode, use_cache=False)

    prompt = drafting_prompt(model)
    runs = {"plain": run(prompt, "off"), "lookup": run(prompt, "lookup")}
    for base in (prompt, *BASES):
        plain = runs["plain"] if base is prompt else run(base, "off")
        if len(plain.token_ids) < MAX_TOKENS:
            continue  # an early end leaves too few drafts
        agree = draft_agreement(model, base, plain.token_ids)
        if 2 <= sum(agree) <= len(agree) - 2:
            return runs | {"plain_base": plain, "draft": run(base, "draft")}
    raise AssertionError(f"{model.path.name}: no prompt where the noisy draft agrees only partly")


@pytest.fixture(scope="module")
def greedy_runs(family):
    """greedy_runs(name) -> speculative_runs of the family's model, computed once."""
    done: dict[str, dict] = {}

    def runs(name: str) -> dict:
        if name not in done:
            done[name] = speculative_runs(family(name))
        return done[name]

    return runs


# ---- 1. greedy identity on every verified family ---------------------------------------------------------------


def assert_same_answer(result: mlxinfer.GenerationResult, plain: mlxinfer.GenerationResult) -> None:
    assert result.token_ids == plain.token_ids and result.text == plain.text
    assert result.stats.finish_reason == plain.stats.finish_reason
    assert result.stats.generated_tokens == plain.stats.generated_tokens


def assert_speculation_is_exact(runs: dict[str, mlxinfer.GenerationResult]) -> None:
    lookup, draft = runs["lookup"], runs["draft"]
    assert_same_answer(lookup, runs["plain"])
    assert_same_answer(draft, runs["plain_base"])
    assert (lookup.stats.speculation, draft.stats.speculation) == ("lookup", "draft")
    assert lookup.stats.drafted_tokens > 0  # drafts were really verified, not skipped
    # The noisy draft agrees partly: some drafts kept (the accept path), some taken back (the rollback path).
    assert 0 < draft.stats.accepted_tokens < draft.stats.drafted_tokens


@pytest.mark.slow
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_greedy_speculation_equals_plain_decoding(name, greedy_runs):
    assert_speculation_is_exact(greedy_runs(name))


def test_across_families_lookup_drafts_are_both_kept_and_rejected(greedy_runs):
    lookups = [greedy_runs(name)["lookup"].stats for name in ARCHITECTURES]
    drafts = [greedy_runs(name)["draft"].stats for name in ARCHITECTURES]
    accepted, drafted = sum(s.accepted_tokens for s in lookups), sum(s.drafted_tokens for s in lookups)
    assert 0 < accepted < drafted
    assert sum(s.accepted_tokens > 0 for s in lookups) >= 5  # several families kept some
    rate = sum(s.accepted_tokens for s in drafts) / sum(s.drafted_tokens for s in drafts)
    assert 0.2 < rate < 0.9, rate


# ---- 2. a rollback leaves every kind of cache as a cold run of the kept tokens leaves it ------------------------


@pytest.fixture(scope="module")
def decoder(wide):
    """decoder(name) -> the tiny model's DecoderLM; "wide:NAME" is NAME with head_dim 64 (quantized KV)."""
    loaded: dict[str, object] = {}

    def get(name: str):
        if name not in loaded:
            path = wide(name[5:]) if name.startswith("wide:") else TINY / name
            loaded[name] = mlxinfer.load(path, prefix_cache_bytes=0)._loaded.model
        return loaded[name]

    return get


def greedy(lm, prompt: list[int], n: int, kv_bits: int | None = None) -> list[int]:
    """Plain greedy decoding, one model call per token on a fresh cache: the reference continuation."""
    cache = make_cache(lm.cache_kinds, kv_bits)
    logits = lm(mx.array([prompt]), cache)[0, -1]
    out = []
    for _ in range(n):
        out.append(int(mx.argmax(logits).item()))
        logits = lm(mx.array([[out[-1]]]), cache)[0, -1]
    return out


def cold_cache(lm, ids: list[int], kv_bits: int | None):
    """The cache of one forward pass over `ids`, nothing fed and taken back."""
    cache = make_cache(lm.cache_kinds, kv_bits)
    mx.eval(lm(mx.array([ids]), cache))
    return cache


def held(cache) -> list[mx.array]:
    """A position cache's arrays as floats (quantized triplets dequantized), positions on axis 2."""
    state = list(cache.state)
    if isinstance(cache, QuantizedKVCache):
        return [mx.dequantize(*state[i : i + 3], group_size=cache.group_size, bits=cache.bits) for i in (0, 3)]
    return state


def assert_same_caches(got, want, atol: float = 1e-4) -> None:
    """Layer by layer: the same length, and the same arrays at every position both hold (a window holds only
    its last ones: at least the window - 1 that the next query reads); recurrent states equal."""
    assert [c.length for c in got] == [c.length for c in want]
    for layer, (g, w) in enumerate(zip(got, want)):
        if isinstance(g, StateCache):
            assert len(g.arrays) == len(w.arrays) > 0
            for a, b in zip(g.arrays, w.arrays):
                np.testing.assert_allclose(np.array(a), np.array(b), atol=atol, err_msg=f"layer {layer}")
            continue
        if g.window is not None:
            assert g.start <= g.length - (g.window - 1), f"layer {layer} lost positions its window still sees"
        first = max(g.start, w.start)
        for a, b, step in zip(held(g), held(w), grid_steps(g)):
            a, b = a[..., first - g.start :, :], b[..., first - w.start :, :]
            assert a.shape == b.shape and a.shape[2] > 0
            if step is None:
                np.testing.assert_allclose(np.array(a), np.array(b), atol=atol, err_msg=f"layer {layer}")
            else:
                assert_same_on_the_grid(np.array(a), np.array(b), np.array(step[..., first - g.start :, :]), atol)


def grid_steps(cache) -> list[mx.array | None]:
    """Per element of held(cache), the quantization grid's step there (the group's scale); None when not quantized."""
    if not isinstance(cache, QuantizedKVCache):
        return [None, None]
    state = list(cache.state)
    return [mx.repeat(state[i + 1], cache.group_size, axis=-1) for i in (0, 3)]


def assert_same_on_the_grid(a: np.ndarray, b: np.ndarray, step: np.ndarray, atol: float) -> None:
    """Quantized values equal, but for the rare one whose float input sat on a rounding boundary: the same
    computation batched or alone differs in its last bits, which may move it to the next grid point (one step)."""
    off = np.abs(a - b) > atol
    assert np.all(np.abs(a - b)[off] <= np.abs(step[off]) * 1.01 + atol), "a value moved by more than one grid step"
    assert off.mean() < 0.01, f"{off.sum()} of {off.size} values moved a grid step: more than rounding explains"


ROUNDS = [(3, 1), (0, 2), (4, 4), (2, 4), (1, 0)]  # drafts each row's sampler accepts per round (of K)
K = 4


def speculate_rows(lm, prompts: list[list[int]], kv_bits: int | None) -> tuple[DecodeBatch, list[list[int]]]:
    """Rows decoding together through DecodeBatch.verify with drafts of which a known number are right;
    checks each round's tokens against plain greedy decoding. Returns the batch and each row's tokens drawn."""
    n = sum(min(r) + 1 for r in ROUNDS) + 2 + K
    refs = [greedy(lm, prompt, n, kv_bits) for prompt in prompts]
    batch = DecodeBatch(lm, kv_bits)
    for prompt, ref in zip(prompts, refs):
        row = Running(Job(prompt, lambda event: None), Sampler(SamplingParams(), VOCAB), None, None, drawn=[ref[0]])
        batch.join(row, cold_cache(lm, prompt, kv_bits))
    at = 0  # refs[r][at] is each row's last drawn token
    for right in ROUNDS:
        drafts = []
        for ref, good in zip(refs, right):
            wrong = [(t + 1) % 256 for t in ref[at + 1 + good : at + 1 + K]]
            drafts.append(Draft(ref[at + 1 : at + 1 + good] + wrong))
        out = batch.verify(drafts, [None] * len(prompts))
        kept = min(right) + 1  # rows stay aligned: the fewest accepted, plus the target's own token
        assert out == [ref[at + 1 : at + 1 + kept] for ref in refs], right
        for row, tokens in zip(batch.rows, out):
            row.drawn.extend(tokens)
        at += kept
    return batch, [ref[: at + 1] for ref in refs]


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 256, n).tolist()


ROLLBACK = [
    ("llama_classic", None),  # full attention
    ("wide:llama_classic", 8),  # quantized keys and values
    ("wide:llama_classic", 4),
    ("gemma3_long", None),  # sliding windows (of 4) past their regrowth, and full attention
    ("gpt_oss", None),  # windows with attention sinks
    ("wide:gpt_oss", 8),  # quantized windows
    ("wide:qwen3_next", 4),  # quantized attention beside recurrent layers
    ("qwen3_next", None),  # recurrent: Gated DeltaNet
    ("lfm2", None),  # recurrent: short convolutions
    ("granitemoehybrid", None),  # recurrent: Mamba-2
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "kv_bits"), ROLLBACK)
def test_rollback_leaves_the_cache_of_a_cold_run_of_the_kept_tokens(name, kv_bits, decoder):
    lm = decoder(name)
    windowed = any(kind == "sliding_attention" for kind, _ in lm.cache_kinds)
    # Rows of different lengths; with windows the longer one crosses a storage step (STEP) during the rounds,
    # where a window drops what its queries no longer see.
    prompts = [tokens(STEP - 3 if windowed else 30, seed=1), tokens(11, seed=2)]
    batch, drawn = speculate_rows(lm, prompts, kv_bits)
    if windowed:
        assert any(c.window and c.start > 0 for c in batch.cache), "no window regrew: lengthen the prompt"
    for row, (prompt, ids) in enumerate(zip(prompts, drawn)):
        cold = cold_cache(lm, prompt + ids[:-1], kv_bits)  # the cache holds all but the last token drawn
        assert_same_caches(row_cache(batch.cache, row, lm.cache_kinds, kv_bits), cold)
    # And the next step reads it as the cold cache: the same logits.
    got = lm(mx.array([[ids[-1]] for ids in drawn]), batch.cache)[:, -1]
    for row, (prompt, ids) in enumerate(zip(prompts, drawn)):
        want = lm(mx.array([[ids[-1]]]), cold_cache(lm, prompt + ids[:-1], kv_bits))[0, -1]
        np.testing.assert_allclose(np.array(got[row]), np.array(want), atol=1e-4, err_msg=f"row {row}")


@pytest.mark.parametrize("name", ["llama_classic", "gemma3_long", "qwen3_next"])  # full, windowed, recurrent
def test_a_draft_model_takes_back_the_drafts_the_target_rejected(name, decoder):
    lm = decoder(name)  # drafting for itself: its drafts are plain greedy decoding's tokens
    prompt = tokens(30, seed=3)
    ref = greedy(lm, prompt, 6)
    drafter = DraftModel(lm, prompt, SamplingParams(), VOCAB)
    assert drafter.propose(ref[:1], K).tokens == ref[1 : 1 + K]
    drafter.accepted(2)  # the target kept two drafts, then drew a token of its own instead of the third
    recurrent = any(isinstance(c, StateCache) for c in drafter.cache)
    # Its cache holds the prompt, the token drawn and the two kept drafts (a recurrent state: back to before
    # the drafts, fed again at the next proposal).
    assert drafter.fed == len(prompt) + 1 + (0 if recurrent else 2)
    fed = (prompt + ref)[: drafter.fed]
    assert_same_caches(drafter.cache, cold_cache(lm, fed, None))
    drawn = ref[:3] + [(ref[3] + 1) % 256]
    assert drafter.propose(drawn, K).tokens == greedy(lm, prompt + drawn, K)


def test_a_draft_model_whose_window_regrew_while_drafting_starts_its_cache_again(decoder):
    """Drafts are fed one pass each: a window smaller than the drafts may let go of positions before the mark,
    which no rewind can bring back; the drafter then starts afresh rather than failing or drafting wrongly."""
    lm = decoder("gemma3_long")
    window = lm.layout.sliding_window
    assert window - 1 < MAX_DRAFTS  # the case as built: the drafts outrun the window
    prompt = tokens(3 * STEP - 8, seed=4)  # the drafts outgrow the window's storage: a pass regrows it
    drafter = DraftModel(lm, prompt, SamplingParams(), VOCAB)
    while not drafter.propose([7], MAX_DRAFTS).tokens:  # a long prompt goes in a chunk per step: no draft yet
        drafter.accepted(0)
    drafter.accepted(0)
    assert drafter.fed == 0  # started again
    fresh = DraftModel(lm, prompt, SamplingParams(), VOCAB)
    assert drafting(drafter, [7, 9], 4) == drafting(fresh, [7, 9], 4)


def drafting(drafter: DraftModel, drawn: list[int], k: int) -> list[int]:
    """The drafter's first proposal once it has caught up on the prompt."""
    while not (draft := drafter.propose(drawn, k)).tokens:
        drafter.accepted(0)
    return draft.tokens


# ---- 3. a quantized KV cache: the same answers ----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama_classic", "gpt_oss", "qwen3_next"])  # full, windowed, recurrent
def test_quantized_kv_speculation_equals_plain_decoding(name, wide, tmp_path):
    draft = noisy_copy(wide(name), tmp_path / "draft")
    model = mlxinfer.load(wide(name), kv_bits=8, draft_model=draft, prefix_cache_bytes=0, speculate="off")
    assert model.kv_bits == 8
    assert_speculation_is_exact(speculative_runs(model))


# ---- 4. with the rest: the prefix cache, constrained decoding, batching ------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama_classic", "gemma3", "qwen3_next"])  # full, windowed, recurrent
def test_a_prefix_cache_hit_then_speculation_equals_a_cold_plain_run(name, tmp_path):
    model = mlxinfer.load(TINY / name, draft_model=noisy_copy(TINY / name, tmp_path / "draft"), speculate="off")
    prompt = drafting_prompt(model)  # (runs without the prefix cache)
    cold = model.generate(prompt, max_tokens=MAX_TOKENS, speculate="off", use_cache=False)
    model.generate(prompt[:60], max_tokens=2)  # leaves a prefix to resume from
    for mode in ("lookup", "draft"):
        hot = model.generate(prompt, max_tokens=MAX_TOKENS, speculate=mode)
        assert hot.stats.cached_tokens >= 60 and hot.stats.drafted_tokens > 0, mode
        assert_same_answer(hot, cold)
    # The next turn resumes from what the speculative run left in the prefix cache (rolled back, re-fed):
    # all of it but its last token, or all of it where the last step ran pipelined (lookup found nothing).
    turn = prompt + cold.token_ids + [Z]
    later = model.generate(turn, max_tokens=MAX_TOKENS, speculate="off")
    assert 0 <= len(prompt) + len(cold.token_ids) - later.stats.cached_tokens <= 1
    assert_same_answer(later, model.generate(turn, max_tokens=MAX_TOKENS, speculate="off", use_cache=False))


PET = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
STRUCTURES = {  # a constraint, and a prompt whose text lookup finds again in the answer
    "regex": ({"regex": "[ab]{30}"}, "abbaabab" * 6),
    "schema": ({"schema": PET}, 'A pet: {"name": "Rex", "age": 3}\nA pet: {"name": "Tom", "age": 5}\nA pet: '),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama_classic", "gemma3", "qwen3_next"])
@pytest.mark.parametrize("kind", list(STRUCTURES))
def test_constrained_speculation_gives_the_text_of_constrained_plain_decoding(name, kind, family):
    model = family(name)
    structure, prompt = STRUCTURES[kind]
    plain, lookup, draft = (
        model.generate(prompt, max_tokens=40, speculate=mode, use_cache=False, **structure)
        for mode in ("off", "lookup", "draft")
    )
    assert_same_answer(lookup, plain)
    assert_same_answer(draft, plain)
    assert lookup.stats.drafted_tokens > 0  # drafts the grammar allows were verified under its masks
    if kind == "regex":
        assert len(plain.text) == 30 and set(plain.text) <= {"a", "b"}
    else:
        assert plain.text.startswith('{"name":"')


class Collector:
    """One job's events: its tokens, text and end."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.texts: list[str] = []
        self.end: Finished | Failed | None = None
        self.done = threading.Event()

    def __call__(self, event) -> None:
        if isinstance(event, Delta):
            self.texts.append(event.text)
            self.tokens += [event.token] if event.tokens else []
        else:
            self.end = event
            self.done.set()

    def wait(self) -> Collector:
        assert self.done.wait(120), "the job never ended"
        assert isinstance(self.end, Finished), self.end
        return self


def run_jobs(scheduler, jobs: list[dict]) -> list[Collector]:
    collectors = [Collector() for _ in jobs]
    for job, collector in zip(jobs, collectors):
        scheduler.submit(Job(on_event=collector, **job))
    return [c.wait() for c in collectors]


def verified_steps(scheduler) -> list[dict[int, list[int]]]:
    """Each batched verification's tokens to emit, by id of the job's Collector (recorded on the scheduler's
    thread)."""
    seen: list[dict[int, list[int]]] = []
    verify = scheduler._batch.verify

    def recorded(drafts, masks):
        out = verify(drafts, masks)
        seen.append({id(row.job.on_event): list(tokens) for row, tokens in zip(scheduler._batch.rows, out)})
        return out

    scheduler._batch.verify = recorded
    return seen


def batched_and_alone(model, scheduler_for, jobs: list[dict]) -> tuple[list[Collector], list[dict]]:
    """The jobs batched (as asked) and each alone with speculate="off": the same tokens, text and ends, never
    more than max_tokens. Returns the batched ones' collectors and their verifications (verified_steps)."""
    alone = scheduler_for(model, max_batch=1)
    expected = [run_jobs(alone, [job | {"speculate": "off"}])[0] for job in jobs]
    batched = scheduler_for(model, max_batch=len(jobs), prefill_chunk=64)
    steps = verified_steps(batched)
    together = run_jobs(batched, jobs)
    for job, want, got in zip(jobs, expected, together):
        assert got.tokens == want.tokens and "".join(got.texts) == "".join(want.texts)
        assert got.end.stats.finish_reason == want.end.stats.finish_reason
        assert len(got.tokens) == got.end.stats.generated_tokens == want.end.stats.generated_tokens
        assert len(got.tokens) <= job["max_tokens"]
    assert any(len(step) >= 2 for step in steps), "no rows verified drafts together"
    return together, steps


def test_batched_rows_speculating_with_a_draft_model_each_equal_their_plain_run_alone(family, scheduler_for):
    model = family("llama_classic")
    prompts = [BASES[0], BASES[1][:9], BASES[2] * 3, [70, 71, 72]]
    jobs = [
        {"prompt_ids": prompt, "max_tokens": most, "speculate": mode}
        for prompt, most, mode in zip(prompts, [16, 7, 12, 4], ["draft", "draft", "draft", "off"])
    ]
    _, steps = batched_and_alone(model, scheduler_for, jobs)
    kept = [len(tokens) for step in steps for tokens in step.values()]
    assert max(kept) > 1 and min(kept) == 1  # drafts were kept, and drafts were taken back


def test_a_stop_inside_a_run_of_accepted_drafts_ends_the_row_there(scheduler_for):
    # A draft model identical to the target: every draft is kept, so runs of several tokens are accepted at once.
    model = mlxinfer.load(TINY / "llama_classic", draft_model=TINY / "llama_classic", prefix_cache_bytes=0)
    answers = [model.generate(prompt, max_tokens=MAX_TOKENS, speculate="off").token_ids for prompt in BASES]
    # A stop string: a printable character first drawn after the first step (of 5 tokens) of the first answer;
    # an end-of-sequence token: the eighth token of the second answer.
    at = next(i for i, t in enumerate(answers[0]) if i > 5 and 33 <= t < 127 and t not in answers[0][:i])
    eos = answers[1][7]
    assert eos not in answers[1][:7]
    jobs = [
        {"prompt_ids": BASES[0], "max_tokens": MAX_TOKENS, "stop": [chr(answers[0][at])]},
        {"prompt_ids": BASES[1], "max_tokens": MAX_TOKENS, "eos_token_ids": frozenset({eos})},
        {"prompt_ids": BASES[2], "max_tokens": 6},  # its last step is cut to the tokens left
    ]
    jobs = [job | {"speculate": "draft"} for job in jobs]
    together, steps = batched_and_alone(model, scheduler_for, jobs)
    assert [len(c.tokens) for c in together] == [at + 1, 7, 6]  # the stop's token counts, the EOS does not

    def step_of(collector: Collector, token: int) -> list[int]:
        return next(step[id(collector)] for step in steps if token in step.get(id(collector), []))

    stop, end = step_of(together[0], answers[0][at]), step_of(together[1], eos)
    assert stop.index(answers[0][at]) < len(stop) - 1  # a kept draft, more kept after it (dropped)
    assert end.index(eos) > 0  # the target's own token after kept drafts (drafts are cut before an EOS)


def test_a_draft_model_catches_up_on_a_long_prompt_a_chunk_per_step(decoder):
    """Its prompt is fed CATCH_UP_TOKENS at a time, between the scheduler's other work (as the target's prefill
    runs), and it drafts only once caught up: a long prompt never stalls the other rows for its whole length."""
    lm = decoder("llama_classic")
    prompt = tokens(2 * CATCH_UP_TOKENS + 100, seed=5)
    drafter = DraftModel(lm, prompt, SamplingParams(), VOCAB)
    for fed in (CATCH_UP_TOKENS, 2 * CATCH_UP_TOKENS):
        assert drafter.propose([7], K).tokens == [] and drafter.fed == fed
        drafter.accepted(0)
    assert drafter.propose([7], K).tokens == greedy(lm, prompt + [7], K)


@pytest.mark.parametrize("speculate", ["lookup", "draft"])
def test_greedy_speculation_with_a_repetition_penalty_equals_plain_decoding(family, speculate):
    """The penalty counts the tokens drawn so far: drafts verified within a step, and the tokens kept by earlier
    speculative steps (the batch observes them after each verification)."""
    model = family("llama_classic")
    prompt = drafting_prompt(model)
    options = {"max_tokens": 24, "repetition_penalty": 1.3, "use_cache": False}
    plain = model.generate(prompt, speculate="off", **options)
    fast = model.generate(prompt, speculate=speculate, **options)
    assert fast.token_ids == plain.token_ids and fast.stats.drafted_tokens > 0
