"""Reasoning switched on or off: a request's effort ("none" ... "high") as the variables its chat template reads.

Templates switch reasoning three ways: Qwen3, Qwen3.5 and Gemma 4 read `enable_thinking`; gpt-oss reads
`reasoning_effort` (low, medium, high: it cannot stop reasoning); Granite reads `thinking`. A model whose
template has no switch either reasons by itself (DeepSeek-R1: asked for "none", it reasons all the same, and its
reasoning still comes apart from the answer) or does not reason at all (asked to, that is refused).
"""

from __future__ import annotations

from typing import Any

from ..untrusted import shown
from .tools import refuse

EFFORTS = ("none", "minimal", "low", "medium", "high")  # OpenAI's reasoning_effort values


def check_effort(effort: Any, param: str = "reasoning_effort") -> str | None:
    """A request's reasoning effort: None (the template's default) or one of EFFORTS."""
    if effort is None or effort in EFFORTS:
        return effort
    raise refuse(f"{param} must be one of {', '.join(EFFORTS)}, got {shown(effort)}", param)


def thinking_variables(effort: str | None, variables: frozenset[str], reasons: bool) -> dict[str, Any]:
    """The template variables for `effort`, given the names the template reads (`variables`) and whether the model
    writes reasoning markup (`reasons`); {} for the template's own default.

    Example:
        >>> thinking_variables("none", frozenset({"enable_thinking", "tools"}), True)
        {'enable_thinking': False}
    """
    if effort is None:
        return {}
    on = effort != "none"
    if "enable_thinking" in variables:
        return {"enable_thinking": on}
    if "reasoning_effort" in variables:
        if not on:
            raise refuse("this model always reasons; its least reasoning_effort is low", "reasoning_effort")
        return {"reasoning_effort": "low" if effort == "minimal" else effort}
    if "thinking" in variables:
        return {"thinking": on}
    if on and not reasons:
        raise refuse(
            "this model does not reason (its chat template has no thinking switch and no reasoning markup); "
            "leave reasoning out",
            "reasoning_effort",
        )
    return {}
