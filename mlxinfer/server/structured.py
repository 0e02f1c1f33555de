"""A request made ready for the engine: prompt ids, the grammar its output must match, and the output's parser.

Runs on the preparing pool (core.py `_prepare`), never on a scheduler's thread: rendering, tokenizing and
compiling a grammar (up to a second for a large schema; cached per tokenizer afterwards) are CPU work
that would stall every running request if done between decode steps.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from dataclasses import dataclass, replace
from typing import Any

from ..api import Model
from ..chat import (
    OutputFormat,
    OutputParser,
    Tool,
    call_grammar,
    default_tool_messages,
    output_format,
    template_messages,
    template_tools,
    thinking_variables,
    with_default_tools,
)
from ..engine import PromptImages, encode_chat
from ..grammar import Constraint, Grammar, constraint_for, json_schema, lark
from ..tokenizer import Tokenizer
from .schema import ChatRequest, CompletionRequest, ResponseFormat

PROMPT_TAIL_TOKENS = 32  # enough to see whether the generation prompt opens a <think> block
_START_RULE = re.compile(r"^start(?=\s*:)", re.MULTILINE)
_FORMATS: weakref.WeakKeyDictionary[Tokenizer, OutputFormat] = weakref.WeakKeyDictionary()
_FORMATS_LOCK = threading.Lock()


@dataclass
class Prepared:
    """What a Job needs beyond the sampling parameters, and how to read what it generates."""

    ids: list[int]
    constraint: Constraint | None = None
    keep_special_tokens: bool = False  # the parser reads markup made of special tokens
    parser: OutputParser | None = None  # None: the text is the answer as generated (completions)
    images: PromptImages | None = None  # the prompt's images, read and placed (engine/image_prompt.py)


def prepare_completion(model: Model, request: CompletionRequest) -> Prepared:
    prompt = request.prompt
    ids = prompt if isinstance(prompt, list) else model.tokenizer.encode(prompt)
    fmt = request.response_format
    return Prepared(ids, _compile(model, json_schema(fmt.schema, where=fmt.where)) if fmt else None)


def prepare_chat(model: Model, request: ChatRequest) -> Prepared:
    """Render with the model's template (with the tools it may call), then pick the grammar and the parser."""
    fmt = format_of(model.tokenizer)
    # tool_choice "none" (OpenAI: "the model will not call any tool") leaves the tools out of the prompt:
    # a model shown functions it may not call still writes calls now and then, which would reach the
    # client as content full of markup. The history's calls and results are rendered all the same.
    tools = request.tools if request.tool_choice.mode != "none" else []
    if fmt.tools is None and (tools or _holds_tools(request.messages)):  # a template without tool syntax
        fmt = with_default_tools(fmt)
        messages, listed = default_tool_messages(request.messages, tools), None
    else:
        messages = template_messages(request.messages, fmt)  # e.g. Mistral's 9-character call ids
        listed = template_tools(tools) if tools else None
    variables = thinking_variables(request.reasoning_effort, model.tokenizer.template_variables, bool(fmt.reasoning))
    ids, images = encode_chat(
        model.tokenizer,
        model.vision,
        messages,
        model.context_tokens,
        tools=listed,
        remote=request.image_sources,
        variables=variables,
        prefix=model.prefix_cache,
    )
    answer = request.response_format
    # The output may start inside a reasoning block the generation prompt opened (then the parser starts there).
    tail = _prompt_tail(model.tokenizer, ids) if fmt.reasoning and answer is None else ""
    parallel = request.parallel_tool_calls
    parser: OutputParser | None = OutputParser(fmt, tools, tail, parallel=parallel)
    if request.tool_choice.mode in ("required", "named"):  # a call, maybe after reasoning
        grammar = lark(call_grammar(fmt, tools, request.tool_choice, parallel, model.tokenizer, tail), where="tools")
    elif answer is not None and tools:  # a call, or the format's JSON
        grammar = _call_or_format(answer, fmt, tools, request, model.tokenizer)
    elif answer is not None:  # the format's JSON from the first token: the text is the answer, nothing to parse
        grammar, parser = json_schema(answer.schema, where=answer.where), None
    else:
        grammar = None
    markup = bool(tools) or (fmt.reasoning is not None and answer is None)
    return Prepared(ids, _compile(model, grammar), fmt.keep_special_tokens and markup, parser, images)


def _call_or_format(
    answer: ResponseFormat, fmt: OutputFormat, tools: list[Tool], request: ChatRequest, tokenizer: Tokenizer
) -> Grammar:
    """tool_choice auto with a response format: the model calls tools (a reasoning block may come first),
    or answers in the format, as OpenAI's models do."""
    any_call = replace(request.tool_choice, mode="required")
    calls = call_grammar(fmt, tools, any_call, request.parallel_tool_calls, tokenizer)
    return lark(either(calls, answer), where=answer.where)


def either(calls: str, answer: ResponseFormat) -> str:
    """A Lark grammar for one of two outputs: `calls` (a Lark grammar whose whole output is `start`) or
    a JSON document matching the response format (compact, as every JSON output here is)."""
    schema = {**answer.schema, "x-guidance": {"whitespace_flexible": False}}  # requests may not set it (schema.py)
    renamed = _START_RULE.sub("tool_calls", calls)
    return f"start: tool_calls | format_answer\nformat_answer: %json {json.dumps(schema)}\n{renamed}\n"


def _holds_tools(messages: list[dict[str, Any]]) -> bool:
    """Whether a history holds tool calls or results (which a template without tool syntax cannot render)."""
    return any(m.get("tool_calls") or m["role"] == "tool" for m in messages)


def format_of(tokenizer: Tokenizer) -> OutputFormat:
    """How the model writes tool calls and reasoning, read from its template once per tokenizer."""
    with _FORMATS_LOCK:
        found = _FORMATS.get(tokenizer)
    if found is None:
        found = output_format(tokenizer.chat_template, tokenizer)
        with _FORMATS_LOCK:
            _FORMATS[tokenizer] = found
    return found


def _prompt_tail(tokenizer: Tokenizer, ids: list[int]) -> str:
    # The parser only needs to know whether the prompt ends inside an open <think>; the tail shows it.
    return tokenizer.decode(ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)


def _compile(model: Model, grammar: Grammar | None) -> Constraint | None:
    if grammar is None:
        return None
    return constraint_for(grammar, model.tokenizer, model.config.vocab_size, model.eos_token_ids)
