"""Semantic labels of prompt tokens (paper Table 6).

Function calling: the chat template writes each offered tool as JSON into the
prompt (Qwen: one ``json.dumps``-ed tool per line inside ``<tools></tools>``).
Each tool's JSON text is located in the prompt (the exact serialisations the
templates use first, then any JSON object in the prompt that decodes to the
tool); inside such a *schema span* characters are labelled by their place in
the JSON:

- function_name: the characters of the function's ``name`` value,
- parameter_key: property names (keys of ``properties`` at any depth) and the
  entries of ``required`` lists,
- type_constraint: ``type`` values (a string or each string of a list),
- enum_constraint: the values inside ``enum`` lists and of ``const``,
- schema_scaffold: everything else in the span -- braces, quotes, separators,
  keywords such as ``"type"``/``"description"``, and descriptions, defaults and
  other unmatched text ("JSON/DDL structure and unmatched tokens within
  validated schema spans").

Quotes around a labelled string belong to the scaffold. Characters outside all
schema spans (system text, the request, chat markers, the template's own
instructions) are protected_content. A token gets the most specific label of
its characters: function_name > parameter_key > enum_constraint >
type_constraint > schema_scaffold > protected_content. A tool whose JSON is not
found leaves its tokens protected_content.

Text-to-SQL: the caller gives the DDL spans it wrote (see :func:`label_sql_prompt`).
"""

from __future__ import annotations

import json
from typing import Any

from pask.structure.tags import LABEL_PRIORITY, PromptLabel

_BY_RANK = sorted(PromptLabel, key=LABEL_PRIORITY.__getitem__)
_SCAF = LABEL_PRIORITY[PromptLabel.SCHEMA_SCAFFOLD]
_FN = LABEL_PRIORITY[PromptLabel.FUNCTION_NAME]
_KEY = LABEL_PRIORITY[PromptLabel.PARAMETER_KEY]
_TYPE = LABEL_PRIORITY[PromptLabel.TYPE_CONSTRAINT]
_ENUM = LABEL_PRIORITY[PromptLabel.ENUM_CONSTRAINT]

SQL_KINDS = {
    "table": PromptLabel.FUNCTION_NAME,
    "column": PromptLabel.PARAMETER_KEY,
    "type": PromptLabel.TYPE_CONSTRAINT,
    "constraint": PromptLabel.ENUM_CONSTRAINT,
    "scaffold": PromptLabel.SCHEMA_SCAFFOLD,
}

_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "additionalItems", "not", "contains", "propertyNames", "if", "then")
_SCHEMA_MAPS = ("$defs", "definitions", "patternProperties", "dependentSchemas")


# -- a position-keeping JSON reader ---------------------------------------------


class _J:
    """A JSON value read from text, with character spans (``start``/``end`` cover the whole value)."""

    __slots__ = ("end", "items", "kind", "start", "value")

    def __init__(self, kind: str, start: int, end: int, value: Any = None, items: list | None = None) -> None:
        self.kind, self.start, self.end, self.value, self.items = kind, start, end, value, items

    def get(self, key: str) -> _J | None:
        if self.kind == "object":
            for k, v in self.items:
                if k.value == key:
                    return v
        return None


_DECODER = json.JSONDecoder()
_WS = " \t\r\n"


def _read(text: str, i: int) -> _J:
    """Read one JSON value starting at ``text[i]``; raise ValueError when it is not JSON."""
    c = text[i]
    if c == "{":
        items: list = []
        j = _skip(text, i + 1)
        if text[j] == "}":
            return _J("object", i, j + 1, items=items)
        while True:
            key = _read(text, j)
            if key.kind != "string":
                raise ValueError("object key is not a string")
            j = _skip(text, key.end)
            if text[j] != ":":
                raise ValueError("':' expected")
            val = _read(text, _skip(text, j + 1))
            items.append((key, val))
            j = _skip(text, val.end)
            if text[j] == "}":
                return _J("object", i, j + 1, items=items)
            if text[j] != ",":
                raise ValueError("',' or '}' expected")
            j = _skip(text, j + 1)
    if c == "[":
        items = []
        j = _skip(text, i + 1)
        if text[j] == "]":
            return _J("array", i, j + 1, items=items)
        while True:
            val = _read(text, j)
            items.append(val)
            j = _skip(text, val.end)
            if text[j] == "]":
                return _J("array", i, j + 1, items=items)
            if text[j] != ",":
                raise ValueError("',' or ']' expected")
            j = _skip(text, j + 1)
    value, end = _DECODER.raw_decode(text, i)
    return _J("string" if c == '"' else "scalar", i, end, value=value)


def _skip(text: str, i: int) -> int:
    while text[i] in _WS:
        i += 1
    return i


def _plain(node: _J) -> Any:
    if node.kind == "object":
        return {k.value: _plain(v) for k, v in node.items}
    if node.kind == "array":
        return [_plain(v) for v in node.items]
    return node.value


# -- locating and labelling tool JSON --------------------------------------------


def _serialisations(tool: dict) -> list[str]:
    outs = []
    for obj in (tool, tool.get("function")):
        if isinstance(obj, dict):
            for kw in ({"ensure_ascii": False}, {}, {"ensure_ascii": False, "sort_keys": True}, {"indent": 4}):
                outs.append(json.dumps(obj, **kw))
    return outs


def find_tool_spans(text: str, tools: list[dict]) -> list[_J]:
    """The JSON values in ``text`` that are the offered tools (or their ``function`` part)."""
    found: list[_J] = []
    taken: set[int] = set()
    missing = []
    for tool in tools:
        for s in _serialisations(tool):
            k = text.find(s)
            while k >= 0 and k in taken:
                k = text.find(s, k + 1)
            if k >= 0:
                try:
                    node = _read(text, k)
                except (ValueError, IndexError):
                    continue
                found.append(node)
                taken.add(k)
                break
        else:
            missing.append(tool)
    if missing:  # other serialisations: any JSON object in the text that decodes to a tool
        wanted = [(t, t.get("function")) for t in missing]
        k = text.find("{")
        while k >= 0 and wanted:
            node = None
            if k not in taken:
                try:
                    node = _read(text, k)
                except (ValueError, IndexError):
                    node = None
            if node is not None and node.kind == "object":
                obj = _plain(node)
                hit = next((w for w in wanted if obj in w), None)
                if hit is not None:
                    wanted.remove(hit)
                    found.append(node)
                    taken.add(k)
                    k = text.find("{", node.end)
                    continue
            k = text.find("{", k + 1)
    return sorted(found, key=lambda n: n.start)


def _content(ranks: bytearray, node: _J, rank: int) -> None:
    """Give every character of a scalar (inside the quotes for strings) at least ``rank``."""
    if node.kind in ("object", "array"):
        for item in node.items:
            _content(ranks, item[1] if node.kind == "object" else item, rank)
        return
    lo, hi = (node.start + 1, node.end - 1) if node.kind == "string" else (node.start, node.end)
    for p in range(lo, hi):
        if ranks[p] < rank:
            ranks[p] = rank


def _label_function(ranks: bytearray, fn: _J) -> None:
    name = fn.get("name")
    if name is not None and name.kind == "string":
        _content(ranks, name, _FN)
    params = fn.get("parameters")
    if params is not None:
        _label_schema(ranks, params, 0)


def _label_schema(ranks: bytearray, node: _J, depth: int) -> None:
    if node.kind != "object" or depth > 64:
        return
    for key, val in node.items:
        k = key.value
        if k == "type":
            if val.kind == "string":
                _content(ranks, val, _TYPE)
            elif val.kind == "array":
                for v in val.items:
                    if v.kind == "string":
                        _content(ranks, v, _TYPE)
        elif k in ("enum", "const"):
            _content(ranks, val, _ENUM)
        elif k == "properties" and val.kind == "object":
            for pk, pv in val.items:
                _content(ranks, pk, _KEY)
                _label_schema(ranks, pv, depth + 1)
        elif k == "required" and val.kind == "array":
            for v in val.items:
                if v.kind == "string":
                    _content(ranks, v, _KEY)
        elif k in _SCHEMA_ONE:
            _label_schema(ranks, val, depth + 1)
        elif k in _SCHEMA_LISTS and val.kind == "array":
            for v in val.items:
                _label_schema(ranks, v, depth + 1)
        elif k in _SCHEMA_MAPS and val.kind == "object":
            for _, v in val.items:
                _label_schema(ranks, v, depth + 1)


def _token_labels(tokenizer, text: str, ranks: bytearray) -> list[PromptLabel]:
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    out = []
    for s, e in enc["offset_mapping"]:
        out.append(_BY_RANK[max(ranks[s:e])] if e > s else PromptLabel.PROTECTED_CONTENT)
    return out


def tool_char_ranks(text: str, tools: list[dict]) -> bytearray:
    """Per-character label rank (:data:`~pask.structure.tags.LABEL_PRIORITY`) of a tool prompt."""
    ranks = bytearray(len(text))
    for node in find_tool_spans(text, tools):
        ranks[node.start : node.end] = bytes([_SCAF]) * (node.end - node.start)
        fn = node.get("function")
        _label_function(ranks, fn if fn is not None and fn.kind == "object" else node)
    return ranks


def label_prompt(tokenizer, prompt_text: str, tools: list[dict]) -> list[PromptLabel]:
    """One label per token of ``tokenizer(prompt_text, add_special_tokens=False)``."""
    return _token_labels(tokenizer, prompt_text, tool_char_ranks(prompt_text, tools))


def label_sql_prompt(tokenizer, prompt_text: str, ddl_spans: list[tuple[int, int, str, str]]) -> list[PromptLabel]:
    """Labels for a text-to-SQL prompt from the DDL spans its builder wrote.

    ``ddl_spans`` are ``(start, end, kind, name)`` character ranges of ``prompt_text``
    with kind ``table`` (→ function_name), ``column`` (→ parameter_key), ``type``
    (→ type_constraint), ``constraint`` (PRIMARY KEY, REFERENCES, NOT NULL, FOREIGN KEY
    ... → enum_constraint) or ``scaffold`` (the rest of the DDL → schema_scaffold).
    Overlaps resolve to the more specific label; uncovered text is protected_content.
    """
    ranks = bytearray(len(prompt_text))
    for start, end, kind, _name in ddl_spans:
        if kind not in SQL_KINDS:
            raise ValueError(f"unknown DDL span kind '{kind}'; expected one of {', '.join(SQL_KINDS)}")
        r = LABEL_PRIORITY[SQL_KINDS[kind]]
        lo, hi = max(0, start), min(len(prompt_text), end)
        for p in range(lo, hi):
            if ranks[p] < r:
                ranks[p] = r
    return _token_labels(tokenizer, prompt_text, ranks)
