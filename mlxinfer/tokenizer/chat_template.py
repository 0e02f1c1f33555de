"""Render Hugging Face chat templates in a jinja2 sandbox, under a budget.

Templates come from model folders, which are untrusted: the immutable sandbox
blocks attribute access to Python internals (`__class__`, `__subclasses__`...)
and mutation of the values we pass in. Settings follow transformers'
`apply_chat_template` (trim_blocks, lstrip_blocks, `raise_exception`,
`strftime_now`, a `tojson` that keeps non-ASCII text).

Each render also runs under a total budget, so no template can stall the
thread that renders it or take the machine's memory: loop iterations plus calls
(macros, methods, filters), nested calls, wall time, characters written and the
size of any one value (wall time is only a generous backstop: the others do not
depend on the machine's load). Loops and calls are counted by code the template's
compiled form runs (a tick first in every loop body, a check in every call), and
operations that multiply sizes (`*`, `+`, joins, replace, indent, format widths)
are measured before they run. Going over ends the render with one ChatTemplateError.
"""

from __future__ import annotations

import copy
import inspect
import json
import re
import time
from collections.abc import Callable
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache, wraps
from typing import Any

import jinja2
import jinja2.meta
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.exceptions import SecurityError
from jinja2.sandbox import MAX_RANGE, ImmutableSandboxedEnvironment

from ..errors import ChatTemplateError

# A 4 MiB request, or a 1M-token context, is about 4M characters: the rendered prompt gets four times that.
MAX_RENDER_CHARS = 16_000_000  # the output, any one value, any one block's output
MAX_WRITTEN_CHARS = 4 * MAX_RENDER_CHARS  # everything written, macro and {% set %} output counted again
MAX_RENDER_ITEMS = 1_000_000  # in any one value, nested ones included (a 4 MiB request holds fewer)
MAX_RENDER_STEPS = 1_000_000  # loop iterations plus calls; real templates take a few per message
MAX_CALL_DEPTH = 64  # macros (or recursive loops) inside each other; real templates nest a few
# A backstop only: steps, depth and sizes are what stop an attack, on any machine. Renders share the GIL, so
# on a loaded machine (4 renders on 2 cores) a legitimate large render may take several times its own speed.
MAX_RENDER_SECONDS = 20.0
MAX_POWER_BITS = 4096  # `**` on integers: real templates never need more


class _BudgetExceeded(jinja2.TemplateError):
    """The render went over one of the MAX_* limits above."""


class _Budget:
    """What one render has spent. Renders share the compiled template, so this lives in a ContextVar."""

    def __init__(self) -> None:
        self.deadline = time.monotonic() + MAX_RENDER_SECONDS
        self.steps = self.depth = self.written = 0

    def step(self) -> None:
        self.steps += 1
        if self.steps > MAX_RENDER_STEPS:
            raise _BudgetExceeded(f"more than {MAX_RENDER_STEPS:,} loop iterations and calls")
        if time.monotonic() > self.deadline:
            raise _BudgetExceeded(f"rendering took more than {MAX_RENDER_SECONDS:g} s")

    def write(self, text: str) -> None:
        self.written += len(text)
        if self.written > MAX_WRITTEN_CHARS:
            raise _BudgetExceeded(f"more than {MAX_WRITTEN_CHARS:,} characters written")


_BUDGET: ContextVar[_Budget] = ContextVar("mlxinfer_chat_template_budget")


def _refuse_over(size: int, what: str) -> None:
    if size > MAX_RENDER_CHARS:
        shown = f"{size:,}" if size < 10**18 else "over 10**18"  # a huge int cannot even be printed
        raise _BudgetExceeded(f"{what} would make {shown} characters or items (at most {MAX_RENDER_CHARS:,})")


def _weight(value: Any) -> int:
    """Characters plus items in `value`, nested ones included, counted until past MAX_RENDER_CHARS.

    A part that appears twice counts twice, as it would in text made from `value`. Measuring visits
    each item, so a value of more than MAX_RENDER_ITEMS items is refused rather than measured."""
    if isinstance(value, str):
        return len(value)
    total, items, stack = 0, 0, [value]
    while stack and total <= MAX_RENDER_CHARS:
        item = stack.pop()
        total += len(item) if isinstance(item, str) else 1
        if isinstance(item, dict):
            item = (*item.keys(), *item.values())
        if isinstance(item, (list, tuple)):
            items += len(item)
            if items > MAX_RENDER_ITEMS:
                raise _BudgetExceeded(f"a value holds more than {MAX_RENDER_ITEMS:,} items")
            stack.extend(item)
    return total


def _checked(value: Any) -> Any:
    _refuse_over(_weight(value), "a value")
    return value


def _sized(value: Any) -> bool:
    return isinstance(value, (str, list, tuple))


# -- operations that multiply sizes, measured before they run ------------------

_FORMAT_SPEC = re.compile(r"%(?:\([^)]*\))?[-+ #0]*\d*(?:\.\d*)?|\{[^{}]*\}")
_NESTED_FIELD = re.compile(r"\{[^{}]*\{")  # "{:>{width}}": the width is an argument


def _check_format(fmt: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> None:
    """Widths and precisions in a %-format or str.format string make that many characters, whether written
    in it (`%99999999d`) or taken from the arguments (`%*d`, `{:{w}}`). Other arguments are only values."""
    if not isinstance(fmt, str):
        return
    widths = (int(n) for spec in _FORMAT_SPEC.findall(fmt) for n in re.findall(r"\d+", spec))
    _refuse_over(max(widths, default=0), "a format width")
    if "*" in fmt or _NESTED_FIELD.search(fmt):
        _check_arguments(args, kwargs or {})


def _check_join(sep: Any, items: list[Any]) -> None:
    _refuse_over(_weight(items) + len(str(sep)) * len(items), "joining")


def _check_replace(text: Any, old: Any, new: Any) -> None:
    if isinstance(text, str) and isinstance(old, str) and isinstance(new, str) and len(new) > len(old):
        _refuse_over(len(text) + text.count(old) * (len(new) - len(old)), "replacing")


def _check_indent(text: Any, width: Any) -> None:
    per_line = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
    _refuse_over((str(text).count("\n") + 1) * per_line, "indenting")


def _check_binop(operator: str, left: Any, right: Any) -> None:
    if operator == "*":
        for seq, count in ((left, right), (right, left)):
            if _sized(seq) and isinstance(count, int):
                _refuse_over(_weight(seq) * count, "repeating a sequence")
    elif operator == "+" and _sized(left) and _sized(right):
        _refuse_over(_weight(left) + _weight(right), "adding sequences")
    elif operator == "%":
        _check_format(left, right if isinstance(right, tuple) else (right,))
    elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
        if right * abs(left).bit_length() > MAX_POWER_BITS:
            raise _BudgetExceeded(f"a power of more than {MAX_POWER_BITS} bits")


def _check_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    # Widths and counts (center, ljust, zfill, batch, slice, tojson's indent) make that many characters or items.
    if any(isinstance(v, int) and abs(v) > MAX_RENDER_CHARS for v in (*args, *kwargs.values())):
        raise _BudgetExceeded(f"an integer argument over {MAX_RENDER_CHARS:,}")


def _check_method(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """Measure a str method's work before it runs; returns `args` (an iterable to join made a list).

    Other callables (macros, cycler, namespace...) only pass values on: their own work is budgeted."""
    func = getattr(func, "__wrapped__", func)  # the sandbox wraps str.format
    owner, name = getattr(func, "__self__", None), getattr(func, "__name__", "")
    if not isinstance(owner, str):
        return args
    if name == "join" and args:
        items = list(args[0])  # an iterator can only be measured by running it
        _check_join(owner, items)
        return (items, *args[1:])
    if name in ("format", "format_map"):
        _check_format(owner, args, kwargs)
        return args
    _check_arguments(args, kwargs)
    if name == "replace" and len(args) >= 2:
        _check_replace(owner, args[0], args[1])
    elif name == "expandtabs":
        tabsize = args[0] if args else kwargs.get("tabsize", 8)
        _refuse_over(owner.count("\t") * (tabsize if isinstance(tabsize, int) else 0), "expanding tabs")
    return args


def _filter_join(arguments: dict[str, Any]) -> None:
    arguments["value"] = list(arguments["value"])
    _check_join(arguments.get("d", ""), arguments["value"])


def _filter_sum(arguments: dict[str, Any]) -> None:
    # Summing sequences copies the running total at each item: quadratic.
    if _sized(arguments.get("start")):
        arguments["iterable"] = items = list(arguments["iterable"])
        _refuse_over(_weight(items) * len(items), "summing sequences")


_FILTER_CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "join": _filter_join,
    "sum": _filter_sum,
    "replace": lambda a: _check_replace(a["s"], a["old"], a["new"]),
    "indent": lambda a: _check_indent(a["s"], a.get("width", 4)),
    "format": lambda a: _check_format(a["value"], a.get("args", ()), a.get("kwargs")),
}


def _budgeted_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """`func`, counted as a step, its work (or its width and count arguments) measured, its result checked."""
    check = _FILTER_CHECKS.get(name)
    signature = inspect.signature(func) if check else None
    value_at = 1 if hasattr(func, "jinja_pass_arg") else 0  # after jinja's context argument, if it takes one

    @wraps(func)  # keeps jinja's pass_context/pass_environment marks
    def run(*args: Any, **kwargs: Any) -> Any:
        _BUDGET.get().step()
        if signature is not None and check is not None:
            bound = signature.bind(*args, **kwargs)
            check(bound.arguments)
            args, kwargs = bound.args, bound.kwargs
        else:
            _check_arguments(args[value_at + 1 :], kwargs)  # the value filtered may be any number
        return _checked(func(*args, **kwargs))

    return run


def _range(*args: int) -> range:
    numbers = range(*args)
    if len(numbers[: MAX_RANGE + 1]) > MAX_RANGE:  # slicing first: len() of a huge range overflows
        raise _BudgetExceeded(f"range() of more than {MAX_RANGE:,} numbers")
    return numbers


# -- the sandbox -----------------------------------------------------------------


class _BudgetedCodeGenerator(CodeGenerator):
    """Compiles loops, `~` and every write so that they report to the render's budget."""

    def visit_For(self, node: nodes.For, frame: Frame) -> None:
        # Every iteration first calls environment.loop_tick, a call that the sandbox counts (and a
        # template cannot shadow, unlike a global name). jinja allows no custom node types.
        tick = nodes.Call(nodes.EnvironmentAttribute("loop_tick"), [], [], None, None, lineno=node.lineno)
        node = copy.copy(node)
        node.body = [nodes.ExprStmt(tick, lineno=node.lineno), *node.body]
        super().visit_For(node, frame)

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.checked(")
        super().visit_Concat(node, frame)
        self.write(")")

    def _output_const_repr(self, group: Any) -> str:
        return f"environment.written({super()._output_const_repr(group)})"

    def _output_child_pre(self, node: nodes.Expr, frame: Frame, finalize: Any) -> None:
        self.write("environment.written(")
        super()._output_child_pre(node, frame, finalize)

    def _output_child_post(self, node: nodes.Expr, frame: Frame, finalize: Any) -> None:
        super()._output_child_post(node, frame, finalize)
        self.write(")")

    def start_write(self, frame: Frame, node: nodes.Node | None = None) -> None:
        super().start_write(frame, node)
        self.write("environment.written(")

    def end_write(self, frame: Frame) -> None:
        self.write(")")
        super().end_write(frame)


class _Sandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, plus the render budget (see the module's docstring)."""

    code_generator_class = _BudgetedCodeGenerator
    intercepted_binops = frozenset({"*", "+", "%", "**"})

    def __init__(self, **options: Any):
        super().__init__(**options)
        self.filters = {name: _budgeted_filter(name, f) for name, f in self.filters.items()}
        self.globals["range"] = _range
        del self.globals["lipsum"]  # megabytes of text from two small numbers; no chat template uses it

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_binop(operator, left, right)
        result = super().call_binop(context, operator, left, right)
        return result if operator in ("*", "+") else _checked(result)  # those two were measured before

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - jinja's names
        budget = _BUDGET.get()
        budget.step()
        args = _check_method(__obj, args, kwargs)
        if budget.depth >= MAX_CALL_DEPTH:
            raise _BudgetExceeded(f"calls nested more than {MAX_CALL_DEPTH} deep")
        budget.depth += 1
        try:
            return _checked(super().call(__context, __obj, *args, **kwargs))
        finally:
            budget.depth -= 1

    @staticmethod
    def concat(parts: Any) -> str:  # joins every buffer: macro output, {% set %} blocks, filter and call blocks
        parts = list(parts)
        _refuse_over(sum(map(len, parts)), "the output of the template or a block")
        return "".join(parts)

    @staticmethod
    def loop_tick() -> None:
        """Called first in every loop iteration; `call` spends the step."""

    @staticmethod
    def checked(value: Any) -> Any:
        return _checked(value)

    @staticmethod
    def written(text: str) -> str:
        _BUDGET.get().write(text)
        return text


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any, indent: int | None = None, ensure_ascii: bool = False, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    _refuse_over(len(fmt) * 32, "a date format")  # %c is 2 characters that become 24
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _budgeted_filter("tojson", _tojson)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template has a syntax error on line {e.lineno}: {e.message}") from None
    except (RecursionError, SyntaxError, MemoryError):  # jinja's parser recurses per level, Python allows 100 blocks
        raise ChatTemplateError("chat template nests its expressions or blocks too deeply to be compiled") from None


@lru_cache(maxsize=16)
def template_variables(source: str) -> frozenset[str]:
    """The names a template reads that it does not define itself: what a caller may pass it (enable_thinking,
    reasoning_effort, tools, ...). A template that does not compile reads none."""
    try:
        environment = _compile(source).environment  # the sandbox's own limits and errors first
    except ChatTemplateError:
        return frozenset()
    return frozenset(jinja2.meta.find_undeclared_variables(environment.parse(source)))


def render_chat(source: str, messages: list[dict[str, Any]], **variables: Any) -> str:
    """Render `messages` with the template `source`; errors (and a spent budget) become ChatTemplateError.

    Example:
        >>> render_chat(template, [{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    """
    template = _compile(source)
    token = _BUDGET.set(_Budget())
    try:
        return template.render(messages=messages, **variables)  # joined by _Sandbox.concat, which measures it
    except _BudgetExceeded as e:
        raise ChatTemplateError(
            f"chat template exhausted its budget: {e} (sandbox limits per render: {MAX_RENDER_CHARS:,} characters "
            f"per value, {MAX_RENDER_STEPS:,} loop iterations and calls, {MAX_CALL_DEPTH} nested calls, "
            f"{MAX_RENDER_SECONDS:g} s); the template is broken or hostile, use a raw prompt instead"
        ) from None
    except SecurityError as e:
        raise ChatTemplateError(f"chat template tried an unsafe operation and was stopped: {_short(e)}") from None
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {_short(e)}") from None
    except (RecursionError, MemoryError) as e:
        raise ChatTemplateError(f"chat template exhausted its resources ({type(e).__name__})") from None
    except Exception as e:  # a template is untrusted code: any failure is the template's
        raise ChatTemplateError(f"chat template failed on these messages: {type(e).__name__}: {_short(e)}") from None
    finally:
        _BUDGET.reset(token)


def _short(error: Exception, limit: int = 300) -> str:
    """The error's text on one line and cut short: a template chooses what raise_exception says."""
    text = " ".join(str(error).split())
    return text if len(text) <= limit else text[:limit] + "..."
