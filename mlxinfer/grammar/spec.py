"""A constraint as data: which texts a generation may produce, as llguidance grammar text.

Nothing here compiles anything: building the grammar text is cheap and bounded by
the input's size, so a request is checked and keyed (for the compiled cache)
before any real work. JSON is compact (no free whitespace), as OpenAI's is: a model
may not pad its answer with endless spaces, and every output that matches parses.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import llguidance

from ..errors import GrammarError
from ..untrusted import shown
from .bounds import check_bounds

MAX_GRAMMAR_CHARS = 1 << 20  # a schema, regex or grammar; real ones are a few KB
MAX_CHOICES = 1024
_COMPACT_JSON = {"whitespace_flexible": False}
# llguidance reads its compile options (free whitespace, leniency that drops unsupported keywords) from this
# key of a schema: they are mlxinfer's to set, never a request's.
OPTIONS_KEY = "x-guidance"


@dataclass(frozen=True)
class Grammar:
    """What a generation must match: `kind` for messages, `text` for llguidance (and the compiled cache's key)."""

    kind: str  # "json_schema", "json_object", "regex", "choices" or "lark"
    text: str
    where: str = "grammar"  # the request field it came from, named in errors


def json_schema(schema: Any, where: str = "schema") -> Grammar:
    """Output that is a JSON document valid against `schema` (a dict, its JSON text, or a pydantic model class).

    Example:
        >>> json_schema({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    """
    schema = bounded_numbers(schema_of(schema, where))
    return Grammar(
        "json_schema", _bounded(llguidance.LLMatcher.grammar_from_json_schema(schema, _COMPACT_JSON), where), where
    )


def json_object(where: str = "response_format") -> Grammar:
    """Any JSON object (OpenAI's `{"type": "json_object"}`), its numbers bounded (any_json_object)."""
    return Grammar(
        "json_object", llguidance.LLMatcher.grammar_from_json_schema(any_json_object(), _COMPACT_JSON), where
    )


def any_json_object() -> dict[str, Any]:
    """A schema for any JSON object whose numbers, at any depth, are bounded as bounded_numbers bounds a schema's:
    `{"type": "object"}` alone lets a tiny model write digits until max_tokens there too."""
    value: dict[str, Any] = {
        "anyOf": [
            {"type": "string"},
            bounded_numbers({"type": "number"}),
            {"type": "boolean"},
            {"type": "null"},
            {"type": "array", "items": {"$ref": "#/$defs/value"}},
            {"type": "object", "additionalProperties": {"$ref": "#/$defs/value"}},
        ]
    }
    return {"type": "object", "additionalProperties": {"$ref": "#/$defs/value"}, "$defs": {"value": value}}


def regex(pattern: str, where: str = "regex") -> Grammar:
    """Output that matches `pattern` whole (Rust regex syntax, no look-around or back-references)."""
    if not isinstance(pattern, str) or not pattern:
        raise GrammarError(f"{where} must be a non-empty regular expression string, got {shown(pattern)}")
    return Grammar("regex", _bounded(llguidance.LLMatcher.grammar_from_regex(pattern), where), where)


def choices(options: Sequence[str], where: str = "choices") -> Grammar:
    """Output that is exactly one of `options`."""
    if isinstance(options, str) or not isinstance(options, Sequence) or not options or len(options) > MAX_CHOICES:
        raise GrammarError(f"{where} must be a list of 1 to {MAX_CHOICES} strings, got {shown(options)}")
    if not all(isinstance(o, str) and o for o in options):
        raise GrammarError(f"{where} must hold non-empty strings only, got {shown(options)}")
    # JSON string escapes are Lark string escapes: any text becomes one literal.
    return Grammar("choices", _bounded("start: " + " | ".join(json.dumps(o) for o in options), where), where)


def lark(text: str, where: str = "grammar") -> Grammar:
    """Output that matches a Lark grammar in llguidance's dialect (`start` is the whole output)."""
    if not isinstance(text, str) or not text.strip():
        raise GrammarError(f"{where} must be non-empty Lark grammar text, got {shown(text)}")
    return Grammar("lark", _bounded(llguidance.LLMatcher.grammar_from_lark(text), where), where)


def schema_of(schema: Any, where: str = "schema") -> dict[str, Any]:
    """`schema` as a JSON-schema dict: given as one, as JSON text, or as a pydantic model class.

    A pydantic class's objects are closed (no properties beyond its fields), as OpenAI's client makes them:
    JSON Schema allows extra keys by default, pydantic ignores them when parsing, and a model left free to
    add keys spends its tokens on fields nobody reads."""
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):  # pydantic v2, without importing it
        return closed_objects(schema.model_json_schema())
    if isinstance(schema, str):
        if len(schema) > MAX_GRAMMAR_CHARS:
            raise GrammarError(f"{where} has {len(schema):,} characters; at most {MAX_GRAMMAR_CHARS:,} are accepted")
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise GrammarError(f"{where} is not valid JSON: {e}") from None
    if isinstance(schema, bool):  # true/false are valid schemas, but false admits nothing
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, Mapping):
        raise GrammarError(f"{where} must be a JSON schema object (or a pydantic model class), got {shown(schema)}")
    check_schema(schema, where)
    return dict(schema)


def check_schema(schema: Mapping[str, Any], where: str) -> None:
    """A GrammarError if a request's `schema` sets the matcher's options or holds more than it may (bounds.py):
    checked where the schema arrives, before anything compiles it."""
    check_no_options(schema, where)
    check_bounds(schema, where)


def check_no_options(schema: Mapping[str, Any], where: str) -> None:
    """A GrammarError if `schema` sets llguidance's own options (OPTIONS_KEY) rather than only constraining output."""
    if OPTIONS_KEY in schema:
        raise GrammarError(
            f'{where} sets "{OPTIONS_KEY}", the matcher\'s own options (whitespace, leniency); leave it out'
        )


def closed_objects(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on every object schema that does not say otherwise."""
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: closed_objects(value) for key, value in schema.items()}
    if closed.get("type") == "object" and "properties" in closed:
        closed.setdefault("additionalProperties", False)
    return closed


# A number's digits, where the schema sets no bounds of its own: llama.cpp's schema grammar allows 16 before the
# point and 16 after. llguidance takes the first as bounds and the second as a multipleOf, which it can write only
# down to 1e-10 (a finer one's reciprocal is no whole float); exponents are then not written at all.
MAX_INTEGER = 10**16 - 1
NUMBER_STEP = 1e-10
_LOWER, _UPPER = ("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")


def bounded_numbers(schema: Any) -> Any:
    """`schema` with every integer and number schema held to at most 16 digits before the point (and a number to 10
    after it), each bound only where the schema sets none (its own bounds stand; where they pass 16 digits, nothing
    is added). A tiny model asked for a number otherwise writes digits until max_tokens."""
    if isinstance(schema, list):
        return [bounded_numbers(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: bounded_numbers(value) for key, value in schema.items()}
    types = out.get("type") if isinstance(out.get("type"), list) else [out.get("type")]
    own = [out[k] for k in (*_LOWER, *_UPPER) if isinstance(out.get(k), (int, float)) and not isinstance(out[k], bool)]
    if ("integer" not in types and "number" not in types) or any(abs(v) > MAX_INTEGER for v in own):
        return out
    if not any(k in out for k in _LOWER):
        out["minimum"] = -MAX_INTEGER
    if not any(k in out for k in _UPPER):
        out["maximum"] = MAX_INTEGER
    if "number" in types and "multipleOf" not in out:
        out["multipleOf"] = NUMBER_STEP
    return out


def _bounded(text: str, where: str) -> str:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"{where} makes a grammar of {len(text):,} characters; at most {MAX_GRAMMAR_CHARS:,}")
    return text
