"""Structured output from Python and the command line: schema=, regex= and choices= on a tiny random model.

A random-weight model would write anything; under a constraint its answers must still be valid. Validity is
judged by references independent of the matcher: `jsonschema`, pydantic and Python's `re`.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Literal

import jsonschema
import pydantic
import pytest
from click.testing import CliRunner

from mlxinfer.cli import main
from mlxinfer.errors import GrammarError, SamplingError
from tests.conftest import TINY

MODEL = str(TINY / "llama_classic")
SEEDS = range(6)
# Nested object, array with bounds, enum, bounded integer and number, optional field.
ORDER = {
    "type": "object",
    "properties": {
        "customer": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 12}, "vip": {"type": "boolean"}},
            "required": ["name", "vip"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "items": {"type": "integer", "minimum": 1, "maximum": 99},
            "minItems": 1,
            "maxItems": 3,
        },
        "size": {"enum": ["S", "M", "L"]},
        "price": {"type": "number", "minimum": 0, "maximum": 500},
        "note": {"type": "string", "maxLength": 8},
    },
    "required": ["customer", "items", "size", "price"],
    "additionalProperties": False,
}


class Pet(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")  # additionalProperties false: no keys beyond these

    name: str = pydantic.Field(max_length=10)
    age: int = pydantic.Field(ge=0, le=30)
    kind: Literal["cat", "dog", "fish"]


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_schema_answers_are_valid_json_for_the_schema(tiny_llama, seed):
    result = tiny_llama.generate("An order:", schema=ORDER, max_tokens=200, temperature=1.0, seed=seed)
    assert result.finish_reason == "stop", result.text  # the grammar completed, not cut at max_tokens
    jsonschema.validate(json.loads(result.text), ORDER)
    assert result.parsed == json.loads(result.text)


def test_schema_given_as_json_text_and_through_chat_and_stream(tiny_llama):
    chat = tiny_llama.chat("An order, please.", schema=json.dumps(ORDER), max_tokens=200)
    jsonschema.validate(chat.parsed, ORDER)
    run = tiny_llama.stream("An order:", schema=ORDER, max_tokens=200, temperature=0.7, seed=3)
    streamed = "".join(run)
    assert streamed == run.text() and run.stats.finish_reason == "stop"
    jsonschema.validate(json.loads(streamed), ORDER)


@pytest.mark.parametrize("seed", SEEDS)
def test_regex_and_choices_answers_match(tiny_llama, seed):
    pattern = r"[a-f]{2,4}-[0-9]{3}( ok)?"
    result = tiny_llama.generate("Code:", regex=pattern, max_tokens=32, temperature=1.0, seed=seed)
    assert re.fullmatch(pattern, result.text), result.text
    options = ["red", "green", "blue", "dark blue"]
    picked = tiny_llama.chat("Pick a color.", choices=options, max_tokens=32, temperature=1.0, seed=seed)
    assert picked.text in options and picked.finish_reason == "stop"
    assert result.parsed is None and picked.parsed is None  # only a schema gives back an object


def test_a_pydantic_class_gives_back_an_instance(tiny_llama):
    for seed in SEEDS:
        result = tiny_llama.generate("A pet:", schema=Pet, max_tokens=128, temperature=1.0, seed=seed)
        assert isinstance(result.parsed, Pet)
        assert result.parsed == Pet.model_validate_json(result.text)
    assert tiny_llama.generate("A pet:", max_tokens=4).parsed is None


class Owner(pydantic.BaseModel):  # pydantic's default: extra keys are ignored when parsing
    name: str = pydantic.Field(max_length=8)
    pet: Pet


def test_a_pydantic_class_answer_holds_its_fields_only(tiny_llama):
    # As OpenAI's client does, a class's objects are closed: the JSON has exactly the fields, nested ones too.
    for seed in SEEDS:
        result = tiny_llama.generate("An owner:", schema=Owner, max_tokens=160, temperature=1.0, seed=seed)
        answer = json.loads(result.text)
        assert set(answer) == {"name", "pet"} and set(answer["pet"]) == {"name", "age", "kind"}, result.text


def test_an_answer_cut_at_max_tokens_does_not_parse_silently(tiny_llama):
    result = tiny_llama.generate("A pet:", schema=Pet, max_tokens=3)
    assert result.finish_reason == "length"
    with pytest.raises(GrammarError, match="max_tokens"):
        _ = result.parsed


def test_two_constraints_at_once_are_refused_naming_both(tiny_llama):
    with pytest.raises(SamplingError, match=r"schema= and regex="):
        tiny_llama.generate("x", schema=Pet, regex="a+")
    with pytest.raises(SamplingError, match=r"regex= and choices="):
        tiny_llama.stream("x", regex="a+", choices=["a"])
    with pytest.raises(SamplingError, match=r"schema= and choices="):
        tiny_llama.chat("x", schema={}, choices=["a"])


def test_an_unsupported_keyword_fails_at_the_call_naming_it(tiny_llama):
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    with pytest.raises(GrammarError, match="uniqueItems"):
        tiny_llama.stream("x", schema=schema)  # compiled before any token: not at the first iteration
    with pytest.raises(GrammarError, match=r"\"if\""):
        tiny_llama.generate("x", schema={"if": {"type": "string"}, "then": {"minLength": 2}})


def run_cli(*args: str):
    return CliRunner().invoke(main, list(args))


def test_cli_schema_prints_valid_json_and_json_output_carries_it_parsed(tmp_path):
    schema_file = tmp_path / "order.json"
    schema_file.write_text(json.dumps(ORDER))
    args = ("generate", MODEL, "-p", "An order:", "--max-tokens", "200", "--schema", str(schema_file))
    result = run_cli(*args, "--raw")
    assert result.exit_code == 0, result.output
    jsonschema.validate(json.loads(result.stdout), ORDER)
    result = run_cli(*args, "--json")
    payload = json.loads(result.stdout)
    assert payload["finish_reason"] == "stop" and payload["parsed"] == json.loads(payload["text"])
    jsonschema.validate(payload["parsed"], ORDER)


def test_cli_regex_and_choice(tmp_path):
    result = run_cli("generate", MODEL, "-p", "Code:", "--raw", "--regex", "[0-9]{3}-[a-z]{2}")
    assert result.exit_code == 0 and re.fullmatch("[0-9]{3}-[a-z]{2}", result.stdout.strip()), result.output
    result = run_cli("generate", MODEL, "-p", "Yes or no?", "--choice", "yes", "--choice", "no")
    assert result.exit_code == 0 and result.stdout.strip() in ("yes", "no"), result.output


@pytest.mark.parametrize(
    "content, words",
    [
        ('{"type": ', "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"type": "array", "uniqueItems": true}', "uniqueItems"),  # found once the tokenizer is loaded
    ],
)
def test_cli_a_bad_schema_file_is_one_line_naming_the_file(tmp_path, content, words):
    schema_file = tmp_path / "bad schema.json"
    schema_file.write_text(content)
    result = run_cli("generate", MODEL, "-p", "x", "--schema", str(schema_file))
    assert result.exit_code == 1, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and str(schema_file) in errors[0] and words in errors[0], result.stderr
    assert result.stdout == ""


def test_cli_missing_file_and_two_constraints(tmp_path):
    result = run_cli("generate", MODEL, "-p", "x", "--schema", str(tmp_path / "missing.json"))
    assert result.exit_code == 1 and "missing.json" in result.stderr, result.output
    result = run_cli("generate", MODEL, "-p", "x", "--regex", "a", "--choice", "b")
    assert result.exit_code == 2 and "--regex and --choice" in result.stderr, result.output


def test_cli_a_cut_off_answer_exits_non_zero(tmp_path):
    schema_file = tmp_path / "order.json"
    schema_file.write_text(json.dumps(ORDER))
    result = run_cli("generate", MODEL, "-p", "x", "--max-tokens", "3", "--schema", str(schema_file))
    assert result.exit_code == 1 and "max_tokens" in result.stderr, result.output


@pytest.mark.slow
def test_structured_bench_quick_writes_its_figures(tmp_path):
    # The real run (`python -m bench --structured-only`) uses the default model; --quick the tiny fixture.
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--structured-only", "--quick", "--out", str(tmp_path)],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(next(tmp_path.glob("*-quick-structured.json")).read_text())
    decode = figures["decode"]
    assert decode["json_schema"]["generated_tokens"] == decode["unconstrained"]["generated_tokens"] == [16]
    assert decode["json_schema"]["text_head"].startswith("{")  # the constrained run wrote JSON
    kinds = {row["grammar"].split(" ")[0] for row in figures["compile"]}
    assert kinds == {"small", "person", "large", "regex", "choices"}
    assert all(row["compile_ms"] > 0 for row in figures["compile"])
    assert set(figures["ttft"]) == {"unconstrained", "new schema", "same schema again"}
    assert "| new schema |" in next(tmp_path.glob("*-quick-structured.md")).read_text()
