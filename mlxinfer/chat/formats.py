"""How a model writes tool calls and reasoning, recognised from its chat template.

Each family's markup is what its real template renders for an assistant tool call
(see tests/fixtures/chat_templates): the model was trained to write the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .tools import refuse

TOOL_FAMILIES = ("hermes", "llama3_json", "mistral", "harmony", "gemma")


@dataclass(frozen=True)
class Markup:
    """Markup around a call or a reasoning block: what opens it, what closes it, and the rest of its kind."""

    opener: str
    closer: str | None = None  # None: the call's JSON ends it
    quote: str = ""  # Gemma: what stands on both sides of a string value
    others: tuple[str, ...] = ()

    @property
    def markers(self) -> frozenset[str]:
        return frozenset(m for m in (self.opener, self.closer, self.quote, *self.others) if m)


HARMONY = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|call|>", "<|return|>")
# The one table of markup: formats (which special tokens to keep), parse (what to split at) and forced (the
# grammars) all read it. Keyed by family, or by dialect where a family's dialects differ (gemma).
CALLS = {
    "hermes": Markup("<tool_call>", "</tool_call>"),
    "llama3_json": Markup("<|python_tag|>"),
    "mistral": Markup("[TOOL_CALLS]", others=("[ARGS]", "[CALL_ID]")),
    # History writes <|start|>assistant to=functions.NAME<|channel|>...<|message|>{...}<|call|>.
    "harmony": Markup("<|start|>", "<|call|>", others=HARMONY),
    # The response markers follow a call where the model stops for the result: never content.
    "gemma4": Markup("<|tool_call>", "<tool_call|>", '<|"|>', ("<|tool_response>", "<tool_response|>")),
    "function_gemma": Markup(
        "<start_function_call>",
        "<end_function_call>",
        "<escape>",
        ("<start_function_response>", "<end_function_response>"),
    ),
}
REASONING = {
    "think": Markup("<think>", "</think>"),
    "gemma": Markup("<|channel>thought", "<channel|>", others=("<|channel>",)),
    "harmony": Markup("<|channel|>analysis<|message|>", "<|end|>", others=HARMONY),
}


# Templates that wrap XML, not JSON, in <tool_call> (Qwen3-Coder, GLM-4.5): a syntax not parsed here.
_XML_CALLS = ("<function=", "<parameter=", "<arg_key>")


@dataclass(frozen=True)
class OutputFormat:
    """How this model writes tool calls and reasoning.

    `tools`: "hermes", "llama3_json", "mistral", "harmony", "gemma", or None (no tool syntax known).
    `reasoning`: "think" (<think>...</think>), "harmony" (the analysis channel), "gemma"
    (<|channel>thought...<channel|>), or None.
    `keep_special_tokens`: decode with special tokens kept, so the parser sees the markup.
    `dialect`: the variant within a family: mistral "v3" ([TOOL_CALLS][{...}]), "v11"
    ([TOOL_CALLS]name[ARGS]{...}) or "v11_call_id" (with [CALL_ID]); gemma "gemma4" or "function_gemma".
    `special_tokens`: the tokenizer's special-token texts; with keep_special_tokens, the parser
    drops those that are not the family's markup (an end-of-turn token must not reach content).
    """

    tools: str | None
    reasoning: str | None
    keep_special_tokens: bool
    dialect: str | None = None
    special_tokens: tuple[str, ...] = ()


def output_format(template: str | None, tokenizer: Any = None) -> OutputFormat:
    """The output format a chat template (and its tokenizer's special tokens) implies.

    Example:
        >>> output_format(tokenizer.chat_template, tokenizer)
        OutputFormat(tools='hermes', reasoning='think', keep_special_tokens=False, ...)
    """
    text = template or ""
    tools, dialect = _tool_family(text)
    reasoning = _reasoning(text, tools)
    specials = tuple(sorted(set(getattr(tokenizer, "special_ids", {}).values()))) if tokenizer is not None else ()
    markers = _markup(tools, dialect, reasoning)
    if tokenizer is not None:
        keep = bool(markers & set(specials))
    else:  # these families' markers are special tokens in their real tokenizers
        keep = tools in ("mistral", "harmony", "gemma") or reasoning in ("harmony", "gemma")
    return OutputFormat(tools, reasoning, keep, dialect, specials if keep else ())


def call_markup(fmt: OutputFormat) -> Markup | None:
    """The markup of this format's tool calls; None where it has no tool syntax."""
    return CALLS.get((fmt.dialect if fmt.tools == "gemma" else fmt.tools) or "")


def markup(fmt: OutputFormat) -> frozenset[str]:
    """Every marker this format writes, for calls and for reasoning."""
    return _markup(fmt.tools, fmt.dialect, fmt.reasoning)


def _markup(tools: str | None, dialect: str | None, reasoning: str | None) -> frozenset[str]:
    calls = CALLS.get((dialect if tools == "gemma" else tools) or "")
    thinking = REASONING.get(reasoning or "")
    return (calls.markers if calls else frozenset()) | (thinking.markers if thinking else frozenset())


def _tool_family(text: str) -> tuple[str | None, str | None]:
    if "<|channel|>" in text and "<|message|>" in text:
        return "harmony", None
    if "[TOOL_CALLS]" in text:
        if "[ARGS]" not in text:
            return "mistral", "v3"
        return "mistral", "v11_call_id" if "[CALL_ID]" in text else "v11"
    if "<|tool_call>" in text:
        return "gemma", "gemma4"
    if "<start_function_call>" in text:
        return "gemma", "function_gemma"
    if "<tool_call>" in text and '"name"' in text and not any(tag in text for tag in _XML_CALLS):
        return "hermes", None
    if "<|start_header_id|>" in text and "tool_calls" in text and '"parameters"' in text:
        return "llama3_json", None
    return None, None


def _reasoning(text: str, tools: str | None) -> str | None:
    if tools == "harmony":
        return "harmony"
    if "<think>" in text or "</think>" in text:  # a template may only open the block (DeepSeek-R1, QwQ)
        return "think"
    if "<|channel>" in text and "<channel|>" in text:
        return "gemma"
    return None


def require_tool_syntax(fmt: OutputFormat) -> None:
    """Refuse tools for a model whose template has no tool-call syntax mlxinfer can parse."""
    if fmt.tools is None:
        raise refuse(
            "this model's chat template has no tool-call syntax mlxinfer knows (known: "
            f"{', '.join(TOOL_FAMILIES)}); leave out tools, or use a model whose template renders tool calls",
            "tools",
        )
