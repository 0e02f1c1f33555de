"""Structured output as the Python API takes it: `schema=`, `regex=` or `choices=`, and the answer parsed back.

The option becomes a grammar (mlxinfer/grammar), compiled for the model's tokenizer
before the request starts, so a schema the matcher cannot enforce fails at the call,
never halfway through an answer. A JSON answer parses back into a dict, or into the
pydantic model class the schema came from.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .. import grammar
from ..errors import GrammarError, SamplingError
from ..grammar import Constraint, Grammar, constraint_for
from ..tokenizer import Tokenizer
from ..untrusted import first_line

OPTIONS = ("schema", "regex", "choices")  # the keyword arguments, at most one per generation


@dataclass(frozen=True)
class Structure:
    """What a generation must match, and how its text reads back (`model_class`: a pydantic class, or None)."""

    grammar: Grammar
    model_class: type | None = None

    @property
    def is_json(self) -> bool:
        return self.grammar.kind in ("json_schema", "json_object")

    def constraint(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> Constraint:
        """A fresh matcher for one request (GrammarError naming what the matcher cannot enforce)."""
        return constraint_for(self.grammar, tokenizer, vocab_size, eos_token_ids)

    def check_complete(self, finish_reason: str) -> None:
        """A GrammarError if the answer ended before its grammar did (cut at max_tokens or cancelled)."""
        if finish_reason in ("length", "cancelled"):
            raise GrammarError(
                f"the answer ended ({finish_reason}) before the {self.grammar.where} was complete; "
                "raise max_tokens (or give the model room to finish)"
            )

    def parse(self, text: str, finish_reason: str) -> Any:
        """The answer as an object: the pydantic class's instance, else the JSON value; None unless JSON."""
        if not self.is_json:
            return None
        self.check_complete(finish_reason)
        try:
            if self.model_class is not None:
                return self.model_class.model_validate_json(text)
            return json.loads(text)
        except ValueError as e:  # json's JSONDecodeError and pydantic's ValidationError are ValueErrors
            # The grammar admits complete, valid JSON only: a stop string cut it, or the class checks more
            # (its own validators) than its JSON schema says.
            raise GrammarError(
                f"the answer does not parse as the {self.grammar.where} ({first_line(e)}); drop stop strings, "
                "or check the model class's validators"
            ) from None


def structure_of(
    schema: Any = None, regex: str | None = None, choices: Sequence[str] | None = None
) -> Structure | None:
    """The one structure asked for (None if none), or a SamplingError naming the options given together.

    Example:
        >>> structure_of(schema={"type": "object", "properties": {"n": {"type": "integer"}}})
    """
    given = [name for name, value in zip(OPTIONS, (schema, regex, choices)) if value is not None]
    if len(given) > 1:
        named = " and ".join(f"{name}=" for name in given)
        raise SamplingError(f"{named} were given together; a generation follows one constraint: keep one of them")
    if schema is not None:
        model_class = schema if isinstance(schema, type) and hasattr(schema, "model_validate_json") else None
        return Structure(grammar.json_schema(schema, where="schema"), model_class)
    if regex is not None:
        return Structure(grammar.regex(regex, where="regex"))
    if choices is not None:
        return Structure(grammar.choices(choices, where="choices"))
    return None
