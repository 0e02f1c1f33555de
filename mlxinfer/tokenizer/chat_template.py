"""Render Hugging Face chat templates in a jinja2 sandbox.

Templates come from model folders, which are untrusted: the immutable sandbox
blocks attribute access to Python internals (`__class__`, `__subclasses__`...)
and mutation of the values we pass in. Settings follow transformers'
`apply_chat_template` (trim_blocks, lstrip_blocks, `raise_exception`,
`strftime_now`, a `tojson` that keeps non-ASCII text).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import ChatTemplateError


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


MAX_REPEAT_ITEMS = 1_000_000  # "x" * n and [..] * n beyond this are refused


class _Sandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, plus a cap on `*` so a template cannot allocate gigabytes."""

    intercepted_binops = frozenset({"*"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if (
                    isinstance(seq, (str, list, tuple))
                    and isinstance(count, int)
                    and len(seq) * count > MAX_REPEAT_ITEMS
                ):
                    raise SecurityError(f"repeating a sequence {count} times exceeds the sandbox limit")
        return super().call_binop(context, operator, left, right)


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template has a syntax error on line {e.lineno}: {e.message}") from None


def render_chat(source: str, messages: list[dict[str, Any]], **variables: Any) -> str:
    """Render `messages` with the template `source`; errors become ChatTemplateError.

    Example:
        >>> render_chat(template, [{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    """
    template = _compile(source)
    try:
        return template.render(messages=messages, **variables)
    except SecurityError as e:
        raise ChatTemplateError(f"chat template tried an unsafe operation and was stopped: {e}") from None
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {e}") from None
    except (RecursionError, MemoryError) as e:
        raise ChatTemplateError(f"chat template exhausted its resources ({type(e).__name__})") from None
    except Exception as e:  # a template is untrusted code: any failure is the template's
        raise ChatTemplateError(f"chat template failed on these messages: {type(e).__name__}: {e}") from None
