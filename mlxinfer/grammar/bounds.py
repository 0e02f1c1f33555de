"""What a JSON schema may hold before it is compiled: the work a request can demand is bounded up front.

llguidance recurses once per nested schema and per `$ref` hop (about 9 KB of native stack a
level: a chain of a few thousand definitions, or tens of thousands of `required` keys, crashes
the process), and checks every pair of `patternProperties` for overlap (minutes for a few
thousand). These limits sit far above real schemas (OpenAI's structured outputs allow 5,000
properties in all and 10 levels of nesting) and far below what hurts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import GrammarError

MAX_SCHEMA_VALUES = 20_000  # JSON values in the whole schema (objects, arrays, strings, numbers, ...)
MAX_KEYS = 1_000  # entries of one `properties`, `required`, `enum` or other list or object of one schema
MAX_DEFINITIONS = 1_000  # entries of `$defs` and `definitions` together
MAX_DEPTH = 64  # JSON objects and arrays nested in each other, with each `$ref` followed (about 2 per schema level)
MAX_PATTERN_PROPERTIES = 64  # `patternProperties` entries in the whole schema (checked pairwise for overlap)
MAX_PATTERNS = 512  # regular expressions in the whole schema (`pattern` and `patternProperties` keys)
MAX_PATTERN_CHARS = 1_000  # one regular expression

_DEFINITIONS = ("$defs", "definitions")


def check_bounds(schema: Any, where: str) -> None:
    """A GrammarError naming the limit if `schema` holds more than it may (see the MAX_ constants).

    Example:
        >>> check_bounds({"type": "object", "required": [f"k{i}" for i in range(5000)]}, "schema")
        Traceback (most recent call last):
        GrammarError: schema.required has 5,000 entries; at most 1,000 are accepted
    """
    definitions = sum(_size(schema.get(key)) for key in _DEFINITIONS) if isinstance(schema, Mapping) else 0
    if definitions > MAX_DEFINITIONS:
        raise GrammarError(f"{where} has {definitions:,} definitions ($defs); at most {MAX_DEFINITIONS:,} are accepted")
    _count(schema, where)
    _Depth(schema, where).check()


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (Mapping, list)) else 0


class _Counts:
    def __init__(self) -> None:
        self.values = self.patterns = self.pattern_properties = 0


def _count(schema: Any, where: str) -> None:
    """Walk every value once (iteratively: a deep document cannot exhaust Python's stack), refusing at the
    first limit passed, so a huge schema costs no more than the limit."""
    counts, pending = _Counts(), [(schema, where)]
    while pending:
        value, path = pending.pop()
        counts.values += 1
        if counts.values > MAX_SCHEMA_VALUES:
            raise GrammarError(f"{where} holds more than {MAX_SCHEMA_VALUES:,} JSON values; at most that are accepted")
        if isinstance(value, Mapping):
            _check_keys(value, path, counts)
            pending.extend((item, f"{path}.{key}") for key, item in value.items())
        elif isinstance(value, list):
            if len(value) > MAX_KEYS:
                raise GrammarError(f"{path} has {len(value):,} entries; at most {MAX_KEYS:,} are accepted")
            pending.extend((item, f"{path}[{i}]") for i, item in enumerate(value))


def _check_keys(value: Mapping[str, Any], path: str, counts: _Counts) -> None:
    if len(value) > MAX_KEYS and not path.endswith(_DEFINITIONS):
        raise GrammarError(f"{path} has {len(value):,} entries; at most {MAX_KEYS:,} are accepted")
    pattern = value.get("pattern")
    if isinstance(pattern, str):
        counts.patterns += 1
        _check_pattern(pattern, f"{path}.pattern")
    patterns = value.get("patternProperties")
    if isinstance(patterns, Mapping):
        counts.patterns += len(patterns)
        counts.pattern_properties += len(patterns)
        if counts.pattern_properties > MAX_PATTERN_PROPERTIES:
            raise GrammarError(
                f"{path}.patternProperties brings the schema's patternProperties to {counts.pattern_properties:,}; "
                f"at most {MAX_PATTERN_PROPERTIES} are accepted"
            )
        for key in patterns:
            _check_pattern(key, f"{path}.patternProperties")
    if counts.patterns > MAX_PATTERNS:
        raise GrammarError(
            f"{path} brings the schema's patterns to {counts.patterns:,}; at most {MAX_PATTERNS} are accepted"
        )


def _check_pattern(pattern: str, where: str) -> None:
    if len(pattern) > MAX_PATTERN_CHARS:
        raise GrammarError(
            f"{where} has a pattern of {len(pattern):,} characters; at most {MAX_PATTERN_CHARS:,} are accepted"
        )


class _Depth:
    """How deep the schema's JSON goes once its local `$ref`s are followed, stopping at the first level past
    MAX_DEPTH (so a deep document costs no more than the limit, in Python's stack too).

    A reference back to a schema already open on the path (a recursive schema, such as a tree) adds no
    depth: the compiler makes it a rule that refers to itself rather than expanding it."""

    def __init__(self, root: Any, where: str):
        self.root, self.where = root, where
        self.open: set[str] = set()
        self.deepest: dict[str, int] = {}  # a definition's depth, computed once (memo: a DAG of refs stays linear)

    def check(self) -> None:
        self._of(self.root, 0)

    def _of(self, value: Any, level: int) -> int:
        """The levels below `value`, which sits `level` levels down."""
        if level > MAX_DEPTH:
            raise self._too_deep()
        if isinstance(value, list):
            return max((self._of(item, level) for item in value), default=0)
        if not isinstance(value, Mapping):
            return 0
        below = 0
        for key, item in value.items():
            if key in _DEFINITIONS:  # definitions count where they are used, not where they are listed
                continue
            if isinstance(item, (Mapping, list)):
                below = max(below, 1 + self._of(item, level + 1))
        ref = value.get("$ref")
        if isinstance(ref, str):
            below = max(below, self._ref(ref, level))
        return below

    def _too_deep(self) -> GrammarError:
        return GrammarError(
            f"{self.where} is nested more than {MAX_DEPTH} levels deep (JSON objects and arrays, counting each "
            f"$ref followed as one more); at most {MAX_DEPTH} are accepted"
        )

    def _ref(self, ref: str, level: int) -> int:
        if ref in self.open:
            return 0
        if ref in self.deepest:
            depth = self.deepest[ref]
            if level + depth > MAX_DEPTH:
                raise self._too_deep()
            return depth
        target = _local_target(self.root, ref)
        if target is None:
            return 0  # not a local reference: the compiler says what it makes of it
        self.open.add(ref)
        try:
            depth = 1 + self._of(target, level + 1)
        finally:
            self.open.discard(ref)
        self.deepest[ref] = depth
        return depth


def _local_target(root: Any, ref: str) -> Any:
    """What a local JSON pointer (`#/$defs/name`) names in `root`, or None."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
