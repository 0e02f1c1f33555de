"""Structured output in the engine: every token drawn obeys its grammar, alone, batched and from the prefix cache.

Expected values come from references, never from the grammar code: jsonschema validates the JSON, Python's `re`
the regexes, each request run alone its batched twin, and llguidance's own mask (or the byte-level tokenizer's
bytes) the masks.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

import jsonschema
import numpy as np
import pytest

import mlxinfer
from mlxinfer.engine import Failed, Finished, GenerationRequest, Job, SamplingParams, ServingThread
from mlxinfer.engine.single import TextGeneration
from mlxinfer.errors import GrammarError
from mlxinfer.grammar import (
    Constraint,
    Grammar,
    allowed_tokens,
    any_json_object,
    choices,
    compiled,
    constraint_for,
    json_object,
    json_schema,
    regex,
)
from mlxinfer.grammar import vocabulary as grammar_vocabulary
from tests.conftest import TINY
from tests.test_scheduler import Collector

SEEDS = 50
MAX_TOKENS = 160  # the tiny model's context is 256; every schema below completes well within this

# Each schema bounds its output (maxLength, maxItems, additionalProperties false) so it ends by itself.
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 999},
                    "tags": {
                        "type": "array",
                        "items": {"type": "string", "maxLength": 4},
                        "minItems": 1,
                        "maxItems": 3,
                    },
                },
                "required": ["id", "tags"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    "enums_and_optional": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L"]},
            "note": {"type": "string", "maxLength": 5},
        },
        "required": ["color"],
        "additionalProperties": False,
    },
    "bounded_numbers": {
        "type": "object",
        "properties": {
            "x": {"type": "number", "minimum": -1.5, "maximum": 2.5},
            "y": {"type": "number", "exclusiveMinimum": 0, "maximum": 10},
            "n": {"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 7},
        },
        "required": ["x", "y", "n"],
        "additionalProperties": False,
    },
    "pattern_and_array": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2,3}$"},
            "digits": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "minItems": 2,
                "maxItems": 4,
            },
        },
        "required": ["code", "digits"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"k": {"type": "string", "minLength": 1, "maxLength": 3}, "v": {"type": "boolean"}},
            "required": ["k", "v"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 3,
    },
    "nullable": {
        "type": "object",
        "properties": {
            "maybe": {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": -5, "maximum": 5}]},
            "s": {"type": "string", "minLength": 2, "maxLength": 4},
        },
        "required": ["maybe", "s"],
        "additionalProperties": False,
    },
    "flags": {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "count": {"type": "integer", "minimum": 0, "maximum": 3}},
        "required": ["ok", "count"],
        "additionalProperties": False,
    },
    "short_list": {
        "type": "object",
        "properties": {"list": {"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 2}},
        "required": ["list"],
        "additionalProperties": False,
    },
}
EMAIL = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
WORDS = ["yes", "no", "maybe later"]


@dataclass(frozen=True)
class Case:
    """A grammar and the reference check its every output must pass."""

    grammar: Callable[[], Grammar]
    check: Callable[[str], None]


def schema_case(schema: dict) -> Case:
    jsonschema.Draft202012Validator.check_schema(schema)
    return Case(lambda: json_schema(schema), lambda text: jsonschema.validate(json.loads(text), schema))


def regex_check(text: str) -> None:
    assert re.fullmatch(EMAIL, text), text


def choice_check(text: str) -> None:
    assert text in WORDS, text


CASES = {name: schema_case(schema) for name, schema in SCHEMAS.items()}
CASES["regex"] = Case(lambda: regex(EMAIL), regex_check)
CASES["choices"] = Case(lambda: choices(WORDS), choice_check)


@pytest.fixture(scope="module")
def model() -> mlxinfer.Model:
    """The tiny llama in float32 without a prefix cache: batched rows compute what each computes alone."""
    return mlxinfer.load(TINY / "llama_classic", dtype="float32", prefix_cache_bytes=0)


def batch_rows(scheduler: ServingThread) -> list[list[Constraint | None]]:
    """Per decode step, from the scheduler's thread: the constraint of each row of the batch."""
    seen: list[list[Constraint | None]] = []
    step = scheduler._batch.step

    def recorded(pipelined: bool = False) -> list[int]:
        seen.append([s.job.constraint for s in scheduler._batch.rows])
        return step(pipelined)

    scheduler._batch.step = recorded
    return seen


def constrain(model: mlxinfer.Model, grammar: Grammar) -> Constraint:
    return constraint_for(grammar, model.tokenizer, model.config.vocab_size, model.eos_token_ids)


def prompt(model: mlxinfer.Model, i: int) -> list[int]:
    return model.encode_prompt(f"Request {i}: answer in the format asked. ")


def run_alone(
    model: mlxinfer.Model, ids: list[int], constraint: Constraint | None, max_tokens: int = MAX_TOKENS, **options
) -> TextGeneration:
    """One request on the caller's thread (greedy unless `options` say otherwise); returns the finished run."""
    use_cache = options.pop("use_cache", False)
    request = GenerationRequest(
        ids, max_tokens, SamplingParams(**options), eos_token_ids=model.eos_token_ids, constraint=constraint
    )
    run = TextGeneration(model.runtime, request, use_cache=use_cache)
    for _ in run:
        pass
    return run


def run_together(scheduler: ServingThread, jobs: list[Job]) -> list[Collector]:
    for job in jobs:
        scheduler.submit(job)
    return [job.on_event.wait() for job in jobs]


def job(ids: list[int], constraint: Constraint | None, max_tokens: int = MAX_TOKENS, **options) -> Job:
    return Job(ids, Collector(), max_tokens=max_tokens, sampling=SamplingParams(**options), constraint=constraint)


def finished(collector: Collector) -> str:
    """The text of a request that ended normally because its grammar was complete."""
    assert isinstance(collector.end, Finished), collector.end
    assert collector.end.stats.finish_reason == "stop", (collector.end.stats.finish_reason, collector.text)
    return collector.text


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_every_sampled_output_is_valid(model, scheduler_for, name):
    """50 seeds at temperature 1: the random model's every output passes the reference check and ends by itself."""
    case = CASES[name]
    scheduler = scheduler_for(model, max_batch=8)
    jobs = [job(prompt(model, s), constrain(model, case.grammar()), temperature=1.0, seed=s) for s in range(SEEDS)]
    texts = [finished(c) for c in run_together(scheduler, jobs)]
    for text in texts:
        case.check(text)
    assert len(set(texts)) > 1  # sampling really varied what came out


def test_sampled_output_alone_is_valid(model):
    """The single-request path (the Python API's) masks every token too, first one included."""
    case = CASES["nested"]
    for seed in range(5):
        run = run_alone(model, prompt(model, seed), constrain(model, case.grammar()), temperature=1.0, seed=seed)
        assert run.stats.finish_reason == "stop"
        case.check(run.text())


def test_eight_schemas_batched_equal_each_alone(model, scheduler_for):
    names = list(SCHEMAS)
    assert len(names) == 8
    alone = [run_alone(model, prompt(model, i), constrain(model, CASES[n].grammar())) for i, n in enumerate(names)]
    scheduler = scheduler_for(model, max_batch=8)
    steps = batch_rows(scheduler)
    jobs = [job(prompt(model, i), constrain(model, CASES[n].grammar())) for i, n in enumerate(names)]
    together = run_together(scheduler, jobs)
    assert max(map(len, steps)) == 8  # all eight decoded in one batch
    for name, single, batched in zip(names, alone, together):
        assert single.stats.finish_reason == "stop"
        CASES[name].check(single.text())
        assert finished(batched) == single.text(), name


def test_mixed_batch_unconstrained_rows_equal_their_runs_alone(model, scheduler_for):
    names = ["nested", "flags", "regex", "choices"]
    grammars = [CASES[n].grammar() for n in names] + [None] * 4
    max_tokens = [MAX_TOKENS] * 4 + [24, 31, 17, 40]
    ids = [prompt(model, 20 + i) for i in range(8)]
    alone = [run_alone(model, p, constrain(model, g) if g else None, m) for p, g, m in zip(ids, grammars, max_tokens)]
    scheduler = scheduler_for(model, max_batch=8)
    steps = batch_rows(scheduler)
    jobs = [job(p, constrain(model, g) if g else None, m) for p, g, m in zip(ids, grammars, max_tokens)]
    together = run_together(scheduler, jobs)
    assert any(len(rows) - rows.count(None) >= 2 and rows.count(None) >= 2 for rows in steps)  # masked and free
    for name, single, batched in zip(names, alone, together):
        CASES[name].check(finished(batched))
        assert batched.text == single.text()
    for single, batched, limit in zip(alone[4:], together[4:], max_tokens[4:]):
        assert isinstance(batched.end, Finished)
        assert batched.end.stats.generated_tokens == single.stats.generated_tokens == limit
        assert batched.text == single.text()


def test_a_prefix_cache_hit_still_obeys_the_constraint():
    model = mlxinfer.load(TINY / "llama_classic", dtype="float32", prefix_cache_bytes=64 << 20)
    case, ids = CASES["nested"], prompt(model, 7) * 3
    cold = run_alone(model, ids, constrain(model, case.grammar()), use_cache=False)
    first = run_alone(model, ids, constrain(model, case.grammar()), use_cache=True)
    second = run_alone(model, ids, constrain(model, case.grammar()), use_cache=True)
    assert first.stats.cached_tokens == 0 and second.stats.cached_tokens > 0
    for run in (cold, first, second):
        assert run.stats.finish_reason == "stop"
        case.check(run.text())
    assert second.text() == first.text() == cold.text()


def test_a_schema_compiles_once_and_each_request_starts_fresh(model):
    schema = {
        "type": "object",
        "properties": {"only_here": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["only_here"],
        "additionalProperties": False,
    }
    vocab = grammar_vocabulary(model.tokenizer, model.config.vocab_size, model.eos_token_ids)
    before = vocab.compiled_now
    first = constrain(model, json_schema(schema))
    assert vocab.compiled_now == before + 1
    second = constrain(model, json_schema(schema))
    assert vocab.compiled_now == before + 1  # found in the cache
    # The cached matcher is copied per request: the first request's tokens do not move the second's start.
    ids = prompt(model, 3)
    a = run_alone(model, ids, first, max_tokens=40)
    b = run_alone(model, ids, second, max_tokens=40)
    assert a.stats.finish_reason == b.stats.finish_reason == "stop"
    jsonschema.validate(json.loads(a.text()), schema)
    assert b.text() == a.text()


@pytest.mark.parametrize(
    "make, named",
    [
        (lambda: json_schema({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}), "not"),
        (lambda: json_schema({"type": "object", "dependentSchemas": {"a": {}}}), "dependentSchemas"),
        (lambda: json_schema({"type": "string", "pattern": "(?=a)b+"}), "look-around"),
        (lambda: json_schema({"type": "string", "pattern": r"(a)\1"}), "backreferences"),
        (lambda: regex("(?<=a)b"), "look-around"),
        (lambda: json_schema({"type": "strin"}), "strin"),
        (lambda: json_schema({"type": "object", "properties": {"n": {"type": "integr"}}}), "integr"),
    ],
)
def test_an_unsupported_or_invalid_schema_is_refused_by_name(model, make, named):
    with pytest.raises(GrammarError, match=re.escape(named)):
        constrain(model, make())


class BreaksAfter(Constraint):
    """A constraint whose matcher gives up after `tokens` tokens, as one that hits llguidance's limits does."""

    def __init__(self, real: Constraint, tokens: int):
        super().__init__(real.matcher, real.vocab, real.grammar)
        self.left = tokens

    def advance(self, token: int) -> None:
        if self.left == 0:
            raise GrammarError("the grammar's step limit was hit (a stand-in)")
        self.left -= 1
        super().advance(token)


def over_its_limits(model: mlxinfer.Model, monkeypatch: pytest.MonkeyPatch, name: str) -> Constraint:
    """A real constraint whose lexer runs out of fuel within its first string (llguidance's limits set low)."""
    monkeypatch.setattr(compiled, "LIMITS", {**compiled.LIMITS, "step_lexer_fuel": 200})
    schema = {"type": "object", "properties": {name: {"type": "string", "pattern": "[a-z]{1,40}x[0-9]{3}"}}}
    return constrain(model, json_schema({**schema, "required": [name], "additionalProperties": False}))


@pytest.mark.parametrize("breaks", ["at the first token", "after 6 tokens", "over its limits"])
def test_a_broken_grammar_fails_only_its_own_row(model, scheduler_for, monkeypatch, breaks):
    ids = [prompt(model, 40 + i) for i in range(4)]
    grammars = [CASES["nested"].grammar(), None, CASES["array_of_objects"].grammar(), None]
    alone = [run_alone(model, p, constrain(model, g) if g else None, 30) for p, g in zip(ids, grammars)]
    jobs = [job(p, constrain(model, g) if g else None, 30) for p, g in zip(ids, grammars)]
    if breaks == "over its limits":
        broken = over_its_limits(model, monkeypatch, "in_a_batch")
    else:
        broken = BreaksAfter(constrain(model, CASES["flags"].grammar()), 0 if breaks == "at the first token" else 6)
    scheduler = scheduler_for(model, max_batch=5)
    steps = batch_rows(scheduler)
    together = run_together(scheduler, [*jobs, job(prompt(model, 39), broken, 30)])
    assert max(map(len, steps)) >= 4
    if breaks != "at the first token":  # it broke while decoding with the others
        assert any(broken in rows and len(rows) >= 4 for rows in steps)
    assert isinstance(together[-1].end, Failed) and isinstance(together[-1].end.error, GrammarError)
    for single, batched in zip(alone, together):
        assert isinstance(batched.end, Finished)
        assert batched.text == single.text()
        assert batched.end.stats.finish_reason == single.stats.finish_reason


def test_a_grammar_over_its_limits_fails_loudly_and_is_compiled_afresh(model, monkeypatch):
    """llguidance answers a limit hit with an EOS-only mask: that EOS must fail the request, not end it as "stop"."""
    constraint = over_its_limits(model, monkeypatch, "alone")
    with pytest.raises(GrammarError, match="could not be followed"):
        run_alone(model, prompt(model, 1), constraint)
    # The failed lexer is shared by every copy of the compiled grammar: the next request gets a fresh one.
    vocab = grammar_vocabulary(model.tokenizer, model.config.vocab_size, model.eos_token_ids)
    before = vocab.compiled_now
    fresh = over_its_limits(model, monkeypatch, "alone")
    assert vocab.compiled_now == before + 1
    assert set(np.flatnonzero(np.array(allowed_tokens([fresh], model.config.vocab_size)[0]))) == {ord("{")}


def test_choices_override_what_the_model_prefers(model):
    ids = prompt(model, 0)
    free = run_alone(model, ids, None, max_tokens=12).text()
    assert not any(free.startswith(w[:1]) for w in WORDS)  # the unconstrained model would say something else
    run = run_alone(model, ids, constrain(model, choices(WORDS)))
    assert run.text() in WORDS and run.stats.finish_reason == "stop"


def test_the_mask_allows_exactly_the_next_bytes_of_the_choices(model):
    """The tokenizer is byte-level (token id = byte): the allowed tokens are the next bytes of the choices left."""
    eos = model.eos_token_ids[0]
    constraint = constrain(model, choices(["yes", "no", "yak"]))
    expected = [{ord("y"), ord("n")}, {ord("e"), ord("a")}, {ord("s")}, {eos}]
    for byte, want in zip([*b"yes", None], expected):
        allowed = allowed_tokens([constraint], model.config.vocab_size)
        assert allowed.shape == (1, model.config.vocab_size)
        assert set(np.flatnonzero(np.array(allowed[0]))) == want
        if byte is not None:
            constraint.advance(byte)


def test_the_batch_mask_equals_llguidance_own_mask_per_row(model):
    """Rows computed together in parallel, one unconstrained among them, each equal to its matcher's own mask."""
    size = model.config.vocab_size
    json_row = constrain(model, CASES["nested"].grammar())
    for byte in b'{"user":{"id":12':
        json_row.advance(byte)
    regex_row = constrain(model, regex(EMAIL))
    for byte in b"ab":
        regex_row.advance(byte)
    rows = [json_row, None, regex_row, constrain(model, choices(WORDS))]
    allowed = np.array(allowed_tokens(rows, size))
    assert allowed.shape == (4, size) and allowed.dtype == np.bool_
    assert allowed[1].all()
    for i in (0, 2, 3):
        reference = np.frombuffer(rows[i].matcher.compute_logit_bias(), dtype=np.uint8)[:size] > 0
        assert (allowed[i] == reference).all(), i
        assert 0 < allowed[i].sum() < size


def next_bytes(model: mlxinfer.Model, grammar: Grammar, text: str) -> set[str]:
    """What the grammar lets follow `text` (the tokenizer is byte-level: a token id below 256 is that byte), and
    "EOS" where it may end there."""
    constraint = constrain(model, grammar)
    for byte in text.encode():
        constraint.advance(byte)
    allowed = np.flatnonzero(np.array(allowed_tokens([constraint], model.config.vocab_size)[0]))
    return {chr(t) for t in allowed if t < 128} | ({"EOS"} if set(allowed) & set(model.eos_token_ids) else set())


def test_json_numbers_stop_at_16_digits_and_10_decimals(model):
    # The default model answered {"population_millions":1111111111... until max_tokens: any number of digits fit.
    city = {"type": "object", "properties": {"people": {"type": "integer"}, "share": {"type": "number"}},
            "required": ["people", "share"]}  # fmt: skip
    digits = set("0123456789")
    assert next_bytes(model, json_schema(city), '{"people":' + "9" * 15) >= digits
    assert next_bytes(model, json_schema(city), '{"people":' + "9" * 16) == {","}  # share is required
    assert next_bytes(model, json_schema(city), '{"people":1,"share":-0.' + "5" * 9) >= digits - {"0"}  # no trailing 0
    assert next_bytes(model, json_schema(city), '{"people":1,"share":-0.' + "5" * 10) == {",", "}"}
    # A schema's own bounds stand: wider ones (19 digits) still reach, a narrower one still holds.
    wide = json_schema({"type": "integer", "maximum": 10**18, "minimum": 0})
    assert next_bytes(model, wide, "9" * 16) >= digits and "-" not in next_bytes(model, wide, "")
    assert next_bytes(model, json_schema({"type": "number", "maximum": 5, "minimum": 0}), "5") == {".", "EOS"}


def test_json_object_numbers_are_bounded_at_any_depth(model):
    digits = set("0123456789")
    for grammar in (json_object(), json_schema(any_json_object())):  # the Python API's, the server's
        assert next_bytes(model, grammar, '{"a":[{"b":' + "9" * 15) >= digits
        assert next_bytes(model, grammar, '{"a":[{"b":' + "9" * 16) & digits == set()
        assert next_bytes(model, grammar, '{"a":"' + "9" * 40) >= digits  # strings are not cut
        assert "}" in next_bytes(model, grammar, '{"a":{"b":[true,null,"x",1.5,{}]}')


def test_number_bounds_are_added_only_where_the_schema_sets_none():
    from mlxinfer.grammar.spec import MAX_INTEGER, bounded_numbers

    schema = {"type": "object", "properties": {"n": {"type": ["integer", "null"]}, "x": {"type": "number",
              "exclusiveMinimum": 0, "multipleOf": 0.5}, "s": {"type": "string"}}}  # fmt: skip
    out = bounded_numbers(schema)
    assert out["properties"]["n"] == {"type": ["integer", "null"], "minimum": -MAX_INTEGER, "maximum": MAX_INTEGER}
    assert out["properties"]["x"] == {"type": "number", "exclusiveMinimum": 0, "multipleOf": 0.5,
                                      "maximum": MAX_INTEGER}  # fmt: skip
    assert out["properties"]["s"] == {"type": "string"} and schema["properties"]["n"] == {"type": ["integer", "null"]}
    assert bounded_numbers({"type": "number", "minimum": -1e20}) == {"type": "number", "minimum": -1e20}
