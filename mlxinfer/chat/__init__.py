"""Tool calling and reasoning: requests checked, prompts rendered with tools, output split back apart.

`tools` checks `tools` and `tool_choice`; `messages` checks the chat history (tool
calls and tool results included); `formats` recognises from the chat template how the
model writes tool calls and reasoning; `parse` splits the streamed output into content,
reasoning and tool calls; `forced` builds the llguidance grammar that forces a call
(tool_choice "required" or a named function); `thinking` turns a request's reasoning effort into the
template variables that switch reasoning on or off.

Errors: every refusal is a ToolCallError (a GrammarError for a parameters schema that
cannot be enforced) with a `param` attribute naming the request field at fault, e.g.
"tools[2].function.name", "tool_choice" or "messages[3].tool_calls[0].function.arguments":
`getattr(error, "param", None)` is what a 400 should point at.

The server's order: check_tools, check_tool_choice, check_messages; fmt = output_format(template,
tokenizer); where the template has no tool syntax and tools are used, fmt = with_default_tools(fmt) and the
messages rendered are default_tool_messages(messages, tools) (default_tools.py), else template_messages(messages,
fmt) with tools=template_tools(tools); decode with special tokens kept when fmt.keep_special_tokens;
feed the text to an OutputParser (parallel=request.parallel_tool_calls); for "required" or a
named choice, constrain with call_grammar.
"""

from .default_tools import DEFAULT_TOOLS, default_tool_messages, with_default_tools
from .forced import call_grammar
from .formats import OutputFormat, output_format, require_tool_syntax
from .messages import IMAGE_PARTS, MAX_TOOL_CALLS, check_messages, image_source, template_messages
from .parse import Content, OutputParser, Piece, Reasoning, ToolCall
from .thinking import EFFORTS, check_effort, thinking_variables
from .tools import MAX_TOOLS, Tool, ToolChoice, check_tool_choice, check_tools, template_tools

__all__ = [
    "DEFAULT_TOOLS",
    "EFFORTS",
    "check_effort",
    "thinking_variables",
    "default_tool_messages",
    "with_default_tools",
    "IMAGE_PARTS",
    "MAX_TOOLS",
    "MAX_TOOL_CALLS",
    "Content",
    "OutputFormat",
    "OutputParser",
    "Piece",
    "Reasoning",
    "Tool",
    "ToolCall",
    "ToolChoice",
    "call_grammar",
    "check_messages",
    "check_tool_choice",
    "check_tools",
    "image_source",
    "output_format",
    "require_tool_syntax",
    "template_messages",
    "template_tools",
]
