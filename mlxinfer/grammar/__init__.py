"""Structured output: what a generation must match, compiled once, enforced token by token.

`spec` states a constraint as data (a JSON schema, any JSON object, a regex, a list of
choices, a Lark grammar); `compiled` turns it into llguidance matchers for one
tokenizer, cached by grammar; `mask` turns a matcher's allowed tokens into a
mask the sampler applies on the device.
"""

from .compiled import Constraint, Vocabulary, constraint_for, vocabulary
from .isolated import cancelled_by, check_in_child, end_compiles
from .mask import allowed_tokens, draft_masks
from .spec import (
    MAX_GRAMMAR_CHARS,
    Grammar,
    any_json_object,
    check_schema,
    choices,
    json_object,
    json_schema,
    lark,
    regex,
    schema_of,
)

__all__ = [
    "MAX_GRAMMAR_CHARS",
    "Constraint",
    "Grammar",
    "Vocabulary",
    "allowed_tokens",
    "cancelled_by",
    "check_in_child",
    "end_compiles",
    "draft_masks",
    "check_schema",
    "choices",
    "constraint_for",
    "any_json_object",
    "json_object",
    "json_schema",
    "lark",
    "regex",
    "schema_of",
    "vocabulary",
]
