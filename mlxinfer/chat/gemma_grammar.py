"""Lark rules for Gemma's call arguments: `{key:value,...}` as its template's format_argument writes them.

Keys are bare and sorted (jinja's dictsort: case-insensitive), strings sit between
quote markers, booleans are true/false, None is None. A schema keyword this
grammar cannot enforce is refused by name rather than dropped.
"""

from __future__ import annotations

from typing import Any, Protocol

_IGNORED = {"description", "title", "default", "examples", "$schema", "$comment", "strict"}
_INTEGER = r"/-?(0|[1-9][0-9]*)/"
_NUMBER = r"/-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?/"
MAX_DEPTH = 32


class _Lark(Protocol):
    rules: list[str]

    def lit(self, text: str) -> str: ...

    def text(self, text: str) -> str: ...

    def until(self, name: str, close: str) -> str: ...


class GemmaValues:
    """Builds rules into `lark` (forced._Lark) for values of the schemas it is given."""

    def __init__(self, lark: _Lark, quote: str):
        self.lark, self.quote, self.count = lark, quote, 0
        lark.rules.append(f"gstr: {lark.lit(quote)} {lark.until('gstr_text', quote)}")
        lark.rules += [
            f'gany: gstr | {_NUMBER} | "true" | "false" | "None" | gobj | garr',
            'gobj: "{" (GKEY ":" gany ("," GKEY ":" gany)*)? "}"',
            'garr: "[" (gany ("," gany)*)? "]"',
            "GKEY: /[A-Za-z_][A-Za-z0-9_]*/",
        ]

    def object(self, name: str, schema: dict[str, Any]) -> str:
        """A rule for the call's `{...}`: the parameters schema, an object."""
        return self._rule(name, schema, 0)

    def _rule(self, name: str, schema: Any, depth: int) -> str:
        if depth > MAX_DEPTH:
            raise ValueError(f"schemas nested more than {MAX_DEPTH} deep")
        if schema is True or schema == {}:
            return "gany"
        if not isinstance(schema, dict):
            raise ValueError(f"a schema must be an object, got {type(schema).__name__}")
        unknown = set(schema) - _IGNORED - {"type", "enum", "const", "anyOf", "oneOf", "properties", "required"}
        unknown -= {"items", "additionalProperties", "nullable"}
        if unknown:
            raise ValueError(f"unsupported keyword {sorted(unknown)[0]!r}")
        alternatives = self._alternatives(name, schema, depth)
        if schema.get("nullable"):
            alternatives.append('"None"')
        self.lark.rules.append(f"{name}: {' | '.join(alternatives)}")
        return name

    def _alternatives(self, name: str, schema: dict[str, Any], depth: int) -> list[str]:
        if "const" in schema:
            return [self._literal(schema["const"])]
        if "enum" in schema:
            if not isinstance(schema["enum"], list) or not schema["enum"]:
                raise ValueError("enum must be a non-empty list")
            return [self._literal(v) for v in schema["enum"]]
        for key in ("anyOf", "oneOf"):
            if key in schema:
                if not isinstance(schema[key], list) or not schema[key]:
                    raise ValueError(f"{key} must be a non-empty list")
                return [self._rule(self._name(name), s, depth + 1) for s in schema[key]]
        kinds = schema.get("type", "object" if "properties" in schema else None)
        if kinds is None:
            return ["gany"]
        return [self._typed(name, k, schema, depth) for k in (kinds if isinstance(kinds, list) else [kinds])]

    def _typed(self, name: str, kind: Any, schema: dict[str, Any], depth: int) -> str:
        if kind == "string":
            return "gstr"
        if kind == "integer":
            return _INTEGER
        if kind == "number":
            return _NUMBER
        if kind == "boolean":
            return '"true" | "false"'
        if kind == "null":
            return '"None"'
        if kind == "array":
            item = self._rule(self._name(name), schema.get("items", True), depth + 1)
            return f'"[" ({item} ("," {item})*)? "]"'
        if kind == "object":
            return self._properties(name, schema, depth)
        raise ValueError(f"unsupported type {kind!r}")

    def _properties(self, name: str, schema: dict[str, Any], depth: int) -> str:
        properties = schema.get("properties")
        if not properties:
            return "gobj"
        if not isinstance(properties, dict):
            raise ValueError("properties must be an object")
        required = set(schema.get("required") or ())
        keys = sorted(properties, key=str.lower)  # dictsort's order
        values = [self._rule(self._name(name), properties[k], depth + 1) for k in keys]
        pairs = [f"{self.lark.text(k + ':')} {v}" for k, v in zip(keys, values, strict=True)]
        # first_i: the properties from i on, none written yet; rest_i: some written (a comma before each).
        base = self._name(name)
        for i in range(len(keys), -1, -1):
            if i == len(keys):
                first, rest = ['""'], ['""']
            else:
                first = [f"{pairs[i]} {base}_rest_{i + 1}"] + ([] if keys[i] in required else [f"{base}_first_{i + 1}"])
                rest = [f'"," {pairs[i]} {base}_rest_{i + 1}'] + (
                    [] if keys[i] in required else [f"{base}_rest_{i + 1}"]
                )
            self.lark.rules.append(f"{base}_first_{i}: {' | '.join(first)}")
            self.lark.rules.append(f"{base}_rest_{i}: {' | '.join(rest)}")
        return f'"{{" {base}_first_0 "}}"'

    def _literal(self, value: Any) -> str:
        if isinstance(value, str):  # the client's text between the quote markers: never markup itself
            return f"{self.lark.lit(self.quote)} {self.lark.text(value)} {self.lark.lit(self.quote)}"
        if isinstance(value, bool):
            return '"true"' if value else '"false"'
        if value is None:
            return '"None"'
        if isinstance(value, (int, float)):
            return self.lark.text(str(value))
        raise ValueError(
            f"enum and const values must be strings, numbers, booleans or null, got {type(value).__name__}"
        )

    def _name(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}_{self.count}"
