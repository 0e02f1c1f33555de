"""How numbers and tables are shown: sizes, counted nouns, and HTML tables for Jupyter (imports nothing of ours)."""

from __future__ import annotations

import html
from collections.abc import Iterable


def html_table(caption: str, rows: Iterable[tuple[str, object]]) -> str:
    """A two-column table; every value is escaped."""
    body = "".join(
        f"<tr><th style='text-align:left'>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>"
        for k, v in rows
    )
    return f"<table><caption style='text-align:left'><b>{html.escape(caption)}</b></caption>{body}</table>"


def mib(n: float, digits: int = 1) -> str:
    return f"{n / 2**20:,.{digits}f} MiB"


def plural(n: int, one: str, many: str | None = None) -> str:
    """The count and the noun that agrees with it: plural(1, "prefix", "prefixes") is "1 prefix"."""
    return f"{n:,} {one if n == 1 else many or one + 's'}"
