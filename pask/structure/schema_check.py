"""Check a JSON Schema before any model loads: a clear :class:`~pask.errors.PaskError` naming the property.

llguidance compiles a schema only against a tokenizer, so a contradictory one used to fail after the
model had loaded, with a message about the outermost property only (``required property
'arguments' is unsatisfiable``). :func:`check_json_schema` finds the common causes itself, in
five passes:

0. the nesting depth: subschemas nested more than :data:`MAX_SCHEMA_DEPTH` levels deep are refused
   before anything recursive (``jsonschema``, the passes below, llguidance) sees them;
1. a walk of every subschema (properties, items, anyOf/oneOf/allOf, ``$defs``...) for typos that
   are never meant: an unknown ``type`` name, ``minimum`` above ``maximum`` (likewise the length,
   item and property counts), an empty ``enum``, a local ``$ref`` that resolves to nothing;
2. ``jsonschema``'s check of the schema against its meta-schema (Draft 2020-12 unless ``$schema``
   names another);
3. satisfiability along what a value must contain: a required property, the items an array must
   have, the properties ``minProperties`` asks for, at least one ``anyOf`` branch, ``enum`` /
   ``const`` values of the declared type. An optional property with no possible value is left
   alone, as llguidance leaves it (the output just never has it; BFCL's own tools have such
   properties). A ``$ref`` is satisfiable only if a *finite* value satisfies it (a least fixpoint
   over the local ``$ref`` targets), so a ``$ref`` cycle through what a value must contain
   (``{"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}``, or ``a -> b ->
   a`` through ``$defs``) is refused: llguidance would accept its grammar and then fail or loop
   while decoding. Recursion that can stop (a tree whose children are optional, a nullable link,
   an array that may be empty) stays allowed, but not an array whose *items* can never end, even
   an array that may be empty, nor an object whose additional (or pattern) properties' values can
   never end: llguidance would let an item or a key start;
4. llguidance itself, compiling the schema without a tokenizer.

``where`` names the schema in messages (``tool 'get_weather'``, ``response_format``), and a
property path follows it: ``tool 'get_weather', property 'days': minimum 10 > maximum 1``.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import jsonschema
import llguidance

from pask.errors import PaskError
from pask.structure.json_tagger import walk_pointer

TYPES = ("array", "boolean", "integer", "null", "number", "object", "string")
# common non-JSON-Schema type names (Python's, BFCL's) and the JSON Schema type meant
_TYPE_HINTS = {
    "dict": "object",
    "map": "object",
    "float": "number",
    "double": "number",
    "int": "integer",
    "long": "integer",
    "str": "string",
    "text": "string",
    "bool": "boolean",
    "list": "array",
    "tuple": "array",
    "none": "null",
}
# count keywords whose lower bound must not pass the upper one
_BOUNDS = (
    ("minLength", "maxLength"),
    ("minItems", "maxItems"),
    ("minProperties", "maxProperties"),
    ("minContains", "maxContains"),
)
# subschema-valued keywords the walk descends into (their values at the same path)
_SAME_PATH = ("not", "if", "then", "else")
_LISTS = ("anyOf", "oneOf", "allOf")
# every subschema-valued keyword (2020-12 and draft 4-7), for the depth check: one subschema, a map
# of them, a list of them
_ONE = (
    *_SAME_PATH,
    "additionalProperties",
    "additionalItems",
    "items",
    "contains",
    "propertyNames",
    "unevaluatedItems",
    "unevaluatedProperties",
    "contentSchema",
)
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
_MANY = (*_LISTS, "prefixItems", "items")
MAX_SCHEMA_DEPTH = 32  # subschemas nested deeper than this are refused (pass 0)
_PASSED: dict[str, None] = {}  # schemas (canonical JSON) that passed, oldest first
_PASSED_MAX = 1024
_AT = re.compile(r"^at \d+\(\d+\): ")  # llguidance's source position prefix
# the model's separators, as pask.structure.constraint.JSON_STYLE (not imported: that module loads torch)
_SEPARATORS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def check_json_schema(schema: Any, where: str = "schema") -> None:
    """Raise :class:`PaskError` if ``schema`` is malformed or no JSON value can satisfy it.

    Needs no tokenizer or model. ``where`` starts every message (``tool 'f'``, ``response_format``).
    """
    if not isinstance(schema, (dict, bool)):
        raise PaskError(f"{where}: a JSON Schema must be an object, got {_kind(schema)}")
    if schema is False:
        raise PaskError(f"{where}: unsatisfiable: the schema is false")
    if schema is True:
        return
    check_schema_depth(schema, where)
    try:
        key = json.dumps(schema, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        raise PaskError(f"{where}: the schema is not JSON: {e}") from None
    if key in _PASSED:  # a server sees the same tools request after request
        return
    checker = _Checker(schema, where)
    checker.scan(schema, "")
    _meta_check(schema, where)
    checker.find_productive()
    found = checker.unsat(schema, "", frozenset({"#"}))
    if found is not None:
        raise PaskError(f"{_loc(where, found[0])}: unsatisfiable: {found[1]}")
    _llguidance_check(schema, where)
    if len(_PASSED) >= _PASSED_MAX:
        _PASSED.pop(next(iter(_PASSED)))
    _PASSED[key] = None


def check_schema_depth(schema: Any, where: str = "schema", limit: int = MAX_SCHEMA_DEPTH) -> None:
    """Raise :class:`PaskError` if subschemas nest more than ``limit`` levels deep (without recursion).

    A level is one step into a subschema (a property, ``items``, an ``anyOf`` branch, a ``$defs``
    entry...); a ``$ref`` is not followed. The root is level 0.
    """
    stack: list[tuple[Any, int, str]] = [(schema, 0, "")]
    while stack:
        node, depth, path = stack.pop()
        if not isinstance(node, dict):
            continue
        if depth > limit:
            raise PaskError(f"{_loc(where, path)}: the schema nests deeper than {limit} levels")
        for key in _ONE:
            sub = node.get(key)
            if isinstance(sub, dict):
                stack.append((sub, depth + 1, _child(path, "*") if key == "additionalProperties" else path))
        for key in _MAPS:
            subs = node.get(key)
            if isinstance(subs, dict):
                for name, sub in subs.items():
                    name = name if key == "properties" else f"{key}/{name}"
                    stack.append((sub, depth + 1, _child(path, str(name))))
        for key in _MANY:
            subs = node.get(key)
            if isinstance(subs, list):
                stack.extend((sub, depth + 1, path) for sub in subs)


def check_response_format(schema: Any) -> None:
    """:func:`check_json_schema` for the schema of a ``response_format`` ``json_schema`` request."""
    check_json_schema(schema, "response_format")


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), type(value).__name__
    )


def _loc(where: str, path: str) -> str:
    if not path:
        return where
    if path.startswith(("$defs", "definitions")):
        return f"{where}, in '{path}'"
    return f"{where}, property '{path}'"


def _child(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _short(v: Any) -> str:
    text = json.dumps(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_type(value: Any, t: str) -> bool:
    if t == "integer":
        return _num(value) and float(value).is_integer()
    return {
        "string": isinstance(value, str),
        "number": _num(value),
        "boolean": isinstance(value, bool),
        "null": value is None,
        "array": isinstance(value, list),
        "object": isinstance(value, dict),
    }.get(t, True)


def _types(s: dict) -> list[str] | None:
    t = s.get("type")
    if isinstance(t, str):
        return [t]
    if isinstance(t, list) and all(isinstance(x, str) for x in t):
        return list(t)
    return None


def _type_name(types: list[str]) -> str:
    return f"'{types[0]}'" if len(types) == 1 else " or ".join(f"'{t}'" for t in types)


def _local(ref: Any) -> bool:
    return isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))


class _Checker:
    def __init__(self, root: dict, where: str) -> None:
        self.root, self.where = root, where
        self.refs: set[str] = set()  # the local $refs met by scan
        self.productive: set[str] = set()  # the local $refs a finite value satisfies (find_productive)
        self._fixpoint = False  # unsat: a $ref not (yet) productive is unsatisfiable, without a look inside
        self._touched: set[str] = set()  # the unproductive $refs the last fixpoint evaluation met
        self._why: dict[str, str] = {}  # why an unproductive $ref is: its message, once found

    def fail(self, path: str, cause: str) -> PaskError:
        return PaskError(f"{_loc(self.where, path)}: {cause}")

    # -- pass 1: typos anywhere ------------------------------------------------------------------

    def scan(self, s: Any, path: str) -> None:
        if isinstance(s, bool):
            return
        if not isinstance(s, dict):
            raise self.fail(path, f"a schema must be an object or a boolean, got {_kind(s)}")
        self._scan_type(s, path)
        self._scan_bounds(s, path)
        if "enum" in s:
            if not isinstance(s["enum"], list):
                raise self.fail(path, f"enum must be a list, got {_kind(s['enum'])}")
            if not s["enum"]:
                raise self.fail(path, "enum is empty: no value can match it")
        if _local(s.get("$ref")):  # "#name" is an anchor
            ref = s["$ref"]
            if self.resolve(ref) is None:
                raise self.fail(path, f"$ref '{ref}' points to nothing in the schema")
            self.refs.add(ref)
        props = s.get("properties")
        if isinstance(props, dict):
            for name, sub in props.items():
                self.scan(sub, _child(path, name))
        patterns = s.get("patternProperties")
        if isinstance(patterns, dict):
            for pattern, sub in patterns.items():
                self.scan(sub, _child(path, f"/{pattern}/"))
        for key in _SAME_PATH:
            if key in s:
                self.scan(s[key], path)
        if "additionalProperties" in s:
            self.scan(s["additionalProperties"], _child(path, "*"))
        if "contains" in s:
            self.scan(s["contains"], f"{path}[]")
        items = s.get("items")
        if isinstance(items, list):  # draft 4-7 tuple form
            for i, sub in enumerate(items):
                self.scan(sub, f"{path}[{i}]")
        elif items is not None:
            self.scan(items, f"{path}[]")
        if isinstance(s.get("prefixItems"), list):
            for i, sub in enumerate(s["prefixItems"]):
                self.scan(sub, f"{path}[{i}]")
        for key in _LISTS:
            if isinstance(s.get(key), list):
                for sub in s[key]:
                    self.scan(sub, path)
        for key in ("$defs", "definitions"):
            if isinstance(s.get(key), dict):
                for name, sub in s[key].items():
                    self.scan(sub, _child(path, f"{key}/{name}"))

    def _scan_type(self, s: dict, path: str) -> None:
        if "type" not in s:
            return
        t = s["type"]
        names = t if isinstance(t, list) else [t]
        if not names:
            raise self.fail(path, "type is an empty list")
        for name in names:
            if not isinstance(name, str):
                raise self.fail(path, f"type must be a string or a list of strings, got {_short(t)}")
            if name not in TYPES:
                hint = _TYPE_HINTS.get(name.lower())
                hint = f"; did you mean '{hint}'?" if hint else f" (types: {', '.join(TYPES)})"
                raise self.fail(path, f"unknown type '{name}'{hint}")

    def _scan_bounds(self, s: dict, path: str) -> None:
        for low, high in _BOUNDS:
            lo, hi = s.get(low), s.get(high)
            if _num(lo) and _num(hi) and lo > hi:
                raise self.fail(path, f"{low} {_short(lo)} > {high} {_short(hi)}")
        lows = [(k, s[k], k == "exclusiveMinimum") for k in ("minimum", "exclusiveMinimum") if _num(s.get(k))]
        highs = [(k, s[k], k == "exclusiveMaximum") for k in ("maximum", "exclusiveMaximum") if _num(s.get(k))]
        for lk, lv, lstrict in lows:
            for hk, hv, hstrict in highs:
                if lv > hv or (lv == hv and (lstrict or hstrict)):
                    op = ">" if lv > hv else "="
                    raise self.fail(path, f"{lk} {_short(lv)} {op} {hk} {_short(hv)}: no number lies between them")

    def resolve(self, ref: str) -> Any:
        """The subschema a local ``$ref`` (``#``, ``#/$defs/x``, ``#/properties/a``) points to, else None."""
        if ref == "#":
            return self.root
        if not ref.startswith("#/"):
            return None
        return walk_pointer(self.root, ref[2:].split("/"))

    # -- pass 3: what a value must contain -------------------------------------------------------

    def find_productive(self) -> None:
        """The local $refs that some finite value satisfies: the least fixpoint, from "none is".

        Each target is evaluated with the refs found productive so far taken as satisfiable and the
        others as not; a target is evaluated again only when a ref it met becomes productive.
        """
        users: dict[str, set[str]] = {}  # ref -> the targets whose evaluation met it
        work = sorted(self.refs)
        self._fixpoint = True
        try:
            while work:
                ref = work.pop()
                if ref in self.productive:
                    continue
                self._touched = set()
                if self.unsat(self.resolve(ref), "", frozenset()) is None:
                    self.productive.add(ref)
                    work.extend(users.pop(ref, ()))
                else:
                    for met in self._touched:
                        users.setdefault(met, set()).add(ref)
        finally:
            self._fixpoint = False

    def unsat(self, s: Any, path: str, refs: frozenset[str]) -> tuple[str, str] | None:
        """(path, cause) if no (finite) JSON value satisfies ``s``, else None (``s`` passed the meta-schema
        check). ``refs``: the $refs followed to get here (a $ref met again among them is a cycle)."""
        if s is True or not isinstance(s, (dict, bool)):
            return None
        if s is False:
            return path, "the schema is false"
        ref = s.get("$ref")
        if _local(ref) and ref not in self.productive:
            if self._fixpoint:
                self._touched.add(ref)
                return path, f"$ref '{ref}'"
            if ref in refs:
                return path, (
                    f"$ref '{ref}' recurses without end, so no finite value matches (make the recursion "
                    "optional: a property not required, nullable, or in an array that may be empty)"
                )
            if ref in self._why:
                return path, self._why[ref]
            found = self.unsat(self.resolve(ref), path, refs | {ref})
            if found is not None:
                self._why[ref] = f"{found[1]} (via $ref '{ref}')"
                return found[0], self._why[ref]
        for sub in s.get("allOf", []):
            found = self.unsat(sub, path, refs)
            if found is not None:
                return found
        for key in ("anyOf", "oneOf"):
            branches = s.get(key)
            if isinstance(branches, list) and branches:
                found = [self.unsat(sub, path, refs) for sub in branches]
                if all(f is not None for f in found):
                    return path, f"every {key} branch is unsatisfiable ({key}[0]: {found[0][1]})"
        types = _types(s)
        if types is None:
            return None
        if "const" in s and not any(_is_type(s["const"], t) for t in types):
            return path, f"const {_short(s['const'])} is not of type {_type_name(types)}"
        if isinstance(s.get("enum"), list) and not any(_is_type(v, t) for v in s["enum"] for t in types):
            return path, f"no enum value is of type {_type_name(types)} (enum {_short(s['enum'])})"
        reasons = [self._unsat_as(t, s, path, refs) for t in types]
        if all(r is not None for r in reasons):
            return reasons[0]
        return None

    def _unsat_as(self, t: str, s: dict, path: str, refs: frozenset[str]) -> tuple[str, str] | None:
        if t == "integer":
            return self._integer_range(s, path)
        if t == "object":
            return self._object(s, path, refs)
        if t == "array":
            return self._array(s, path, refs)
        return None

    def _integer_range(self, s: dict, path: str) -> tuple[str, str] | None:
        lo, hi = -math.inf, math.inf
        if _num(s.get("minimum")):
            lo = max(lo, math.ceil(s["minimum"]))
        if _num(s.get("exclusiveMinimum")):
            lo = max(lo, math.floor(s["exclusiveMinimum"]) + 1)
        if _num(s.get("maximum")):
            hi = min(hi, math.floor(s["maximum"]))
        if _num(s.get("exclusiveMaximum")):
            hi = min(hi, math.ceil(s["exclusiveMaximum"]) - 1)
        if lo > hi:
            keys = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")
            bounds = " and ".join(f"{k} {_short(s[k])}" for k in keys if _num(s.get(k)))
            return path, f"no integer satisfies {bounds}"
        return None

    def _object(self, s: dict, path: str, refs: frozenset[str]) -> tuple[str, str] | None:
        props = s.get("properties") if isinstance(s.get("properties"), dict) else {}
        required = [r for r in s.get("required", []) if isinstance(r, str)]
        extra = s.get("additionalProperties", True)
        for name in required:
            sub_path = _child(path, name)
            if name in props:
                found = self.unsat(props[name], sub_path, refs)
                if found is not None:
                    return found
            elif s.get("patternProperties"):
                continue  # a pattern may admit it; llguidance decides
            elif extra is False:
                return sub_path, "required, but not among 'properties' and additionalProperties is false"
            elif isinstance(extra, dict):
                found = self.unsat(extra, sub_path, refs)
                if found is not None:
                    return found
        if not self._fixpoint:  # may an extra property be written? llguidance would let its key start
            pats = s.get("patternProperties") if isinstance(s.get("patternProperties"), dict) else {}
            subs = [(extra, _child(path, "*"))] if isinstance(extra, dict) else []
            subs += [(sub, _child(path, f"/{pat}/")) for pat, sub in pats.items() if isinstance(sub, dict)]
            for sub, sub_path in subs:
                found = self._unending(sub, sub_path, refs, "a property")
                if found is not None:
                    return found
        most = s.get("maxProperties")
        if _num(most) and len(set(required)) > most:
            return path, f"{len(set(required))} required properties > maxProperties {most}"
        least = s.get("minProperties")
        if not _num(least) or least <= len(set(required)) or s.get("patternProperties"):
            return None
        if extra is False or (isinstance(extra, dict) and self.unsat(extra, _child(path, "*"), refs)):
            optional = [n for n, sub in props.items() if n not in required and not self.unsat(sub, path, refs)]
            if len(set(required)) + len(optional) < least:
                return path, f"minProperties {_short(least)} asks for more properties than can have a value"
        return None

    def _array(self, s: dict, path: str, refs: frozenset[str]) -> tuple[str, str] | None:
        least = s.get("minItems", 0) if _num(s.get("minItems", 0)) else 0
        prefix = s.get("prefixItems") if isinstance(s.get("prefixItems"), list) else []
        items = s.get("items")
        if isinstance(items, list):  # draft 4-7 tuple form
            prefix, items = items, s.get("additionalItems", True)
        for i, sub in enumerate(prefix[: int(least)]):
            found = self.unsat(sub, f"{path}[{i}]", refs)
            if found is not None:
                return found
        if least > len(prefix) and items is not None:
            found = self.unsat(items, f"{path}[]", refs)
            if found is not None:
                return found[0], f"{found[1]}, and minItems {least} asks for items"
        elif items is not None and not self._fixpoint:  # the array may be empty: may its items be written?
            return self._unending(items, f"{path}[]", refs, "an item")
        return None

    def _unending(self, sub: Any, path: str, refs: frozenset[str], what: str) -> tuple[str, str] | None:
        """Refuse an optional ``sub`` (an array's items, an object's extra properties) that only a
        ``$ref`` cycle makes unsatisfiable: llguidance would let ``what`` start, then never end it."""
        found = self.unsat(sub, path, refs)
        if found is not None and "$ref" in found[1]:
            return found[0], f"{found[1]}; {what} could be started and never finished"
        return None


def _meta_check(schema: dict, where: str) -> None:
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as e:
        path, keyword = _schema_path(list(e.path))
        keyword = f"{keyword}: " if keyword else ""
        raise PaskError(f"{_loc(where, path)}: not a valid JSON Schema: {keyword}{e.message}") from None


def _schema_path(parts: list) -> tuple[str, str]:
    """A meta-schema error's location as (property path, keyword): properties/a/items/minimum -> a[], minimum."""
    path, i = "", 0
    while i < len(parts):
        p, nxt = parts[i], parts[i + 1] if i + 1 < len(parts) else None
        if p == "properties" and nxt is not None:
            path = _child(path, str(nxt))
        elif p in ("$defs", "definitions") and nxt is not None:
            path = _child(path, f"{p}/{nxt}")
        elif p == "prefixItems" and nxt is not None:
            path += f"[{nxt}]"
        elif p in _LISTS and nxt is not None:
            pass
        elif p in ("items", "contains"):
            path += "[]"
            i += 1
            continue
        elif p == "additionalProperties":
            path = _child(path, "*")
            i += 1
            continue
        else:
            return path, "/".join(str(x) for x in parts[i:])
        i += 2
    return path, ""


def _llguidance_check(schema: dict, where: str) -> None:
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema({**schema, "x-guidance": _SEPARATORS})
    except (ValueError, TypeError, RuntimeError) as e:  # a value it cannot take in: an integer over 64 bits
        raise PaskError(f"{where}: llguidance cannot compile the schema: {e}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if not is_error:
        return
    text = messages[0] if messages else "unknown error"
    first = _AT.sub("", text.strip().splitlines()[0])
    first = first.removeprefix("failed to compile JSON schema: ")
    prop = re.search(r"required property '([^']+)' is unsatisfiable", first)
    context = re.search(r"while processing json-schema:///#/(\S+)", text)
    path = prop.group(1) if prop else ""
    if context and not prop:
        first += f" (at #/{context.group(1)})"
    raise PaskError(f"{_loc(where, path)}: llguidance cannot compile the schema: {first}")
