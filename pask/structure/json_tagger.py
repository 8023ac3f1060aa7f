"""Schema-aware incremental tagger for generated JSON tool calls.

Feed it the bytes of every accepted token, in order (the same step as the
constraint); it returns the token's :class:`~pask.structure.tags.Tag`. Only the
new bytes are processed, by a byte-level state machine with a container stack,
so the cost per token is independent of the output length.

Expected output (Qwen2.5's native format; whitespace between JSON elements is
tolerated)::

    <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>   (blocks joined by "\\n")

Special tokens are fed as their text: ``b"<tool_call>"``, ``b"</tool_call>"``;
end markers of the form ``<|...|>`` (e.g. ``<|im_end|>``) are accepted between
calls as scaffold. An empty ``bytes`` gives a scaffold tag and changes nothing.

Byte roles
----------
Every byte of the output gets (class, role, critical):

- **structure** -- markers, newlines, ``{ } [ ] , :``, the spaces of ``", "`` and
  ``": "``, both quotes of a key and the *opening* quote of a string value:
  (pure_scaffold, scaffold_separator, no).
- **key text** -- the characters between a key's quotes (argument keys at any
  depth, and the ``name``/``arguments`` keys of the call object):
  (schema_bearing, role of the key, yes). The role of a key is ``dispatch_key``
  for ``name``, ``required`` for ``arguments``, and for an argument key
  ``required`` if it is in the ``required`` list of the (sub)schema of the object
  it is written in, else ``optional`` (also for keys the schema does not know).
- **function name** -- the characters of the ``name`` value *and its closing
  quote*: (schema_bearing, dispatch_key, yes).
- **value** -- a scalar argument value: a string's characters *and its closing
  quote* (ending a free string is the model's decision; the opening quote is
  forced by the schema), or all characters of a number / ``true`` / ``false`` /
  ``null``: (free_generation, role of the innermost key owning the value, only
  for the value's first byte). The first byte of a string value is the one after
  its opening quote (the closing quote for ``""``). Array elements are values
  owned by the array's key; the keys of a nested object get their role from the
  nested schema.

A token's tag combines its bytes with the priorities of :mod:`pask.structure.tags`:
class schema_bearing > free_generation > pure_scaffold, role dispatch_key >
required > optional > scaffold_separator, state critical > boundary (critical
iff some byte is critical). So ``",`` after a required string value is
(free_generation, required, boundary), and `` {"`` is pure scaffold.

Partial keys: while a key is still open at the end of a token, its role is
resolved by prefix over the property names of its object's schema: ``required``
if any property starting with the text so far is required, else ``optional``;
once the closing quote is seen the exact key decides. The tool of a call is the
offered tool whose name equals the closed ``name`` value; if ``arguments`` comes
before ``name``, the union of all tools' parameters is used.

Next: ``lookahead_critical`` iff after the token the parser is inside a key or
the function name (before its closing quote), right after a string value's
opening quote, expecting a key (after ``{`` or after ``,`` in an object), or
expecting a value (after ``:``, ``[``, or ``,`` in an array); spaces do not
change it. Else ``no_lookahead`` (inside or after a value, after a key's closing
quote, at the top level).

Schemas: ``properties``/``required``/``additionalProperties``/``patternProperties``,
``items``/``prefixItems``, ``anyOf``/``oneOf``/``allOf`` (union; a key is required if
any branch requires it) and local ``$ref`` (``#/...``, followed lazily, so
recursive schemas work) are followed. A value whose schema cannot be followed (a
``$ref`` cycle that never reaches a schema, a remote or dangling ``$ref``,
``if``/``then``/``else``, ``dependentSchemas``/``dependentRequired``, a non-object
schema) and the arguments of an unknown function are tagged :data:`FALLBACK`,
byte by byte, up to the end of that value. Bytes off the expected format switch
the tagger to an error state: every token is :data:`FALLBACK` until a
``<tool_call>`` marker resynchronises it. ``degraded`` tells whether either
happened since the last :meth:`reset`. The tagger never raises.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pask.structure.tags import FALLBACK, JsonRole, Next, State, Tag, TagClass

OPEN_MARKER = b"<tool_call>"
CLOSE_MARKER = b"</tool_call>"

# Lexer states.
S_TOP = 0  # between calls: "\n", a "<tool_call>" or "<|...|>" marker
S_MARKER = 1  # inside a "<...>" marker
S_BODY = 2  # after "<tool_call>": whitespace, then the call object's "{"
S_VALUE = 3  # a value is expected (after ":", or "," in an array)
S_KEY_OR_CLOSE = 4  # after "{"
S_KEY = 5  # after "," in an object
S_IN_KEY = 6
S_COLON = 7  # after a key's closing quote
S_VAL_OR_CLOSE = 8  # after "["
S_COMMA_OR_CLOSE = 9  # after a value inside a container
S_IN_STR = 10  # inside a string value
S_IN_FNAME = 11  # inside the function name
S_IN_NUM = 12
S_IN_LIT = 13
S_AFTER_BODY = 14  # after the call object: whitespace, then "</tool_call>"
S_ERROR = 15

_LA_STATES = frozenset({S_IN_KEY, S_IN_FNAME, S_KEY_OR_CLOSE, S_KEY, S_VALUE, S_VAL_OR_CLOSE})

# Bits accumulated over a token's bytes; the highest set bit wins.
C_SCAF, C_FREE, C_SCHEMA = 1, 2, 4
R_SEP, R_OPT, R_REQ, R_DISP = 1, 2, 4, 8

QUOTE, BSLASH, COLON, COMMA = 0x22, 0x5C, 0x3A, 0x2C
LBRACE, RBRACE, LBRACK, RBRACK, LT, GT = 0x7B, 0x7D, 0x5B, 0x5D, 0x3C, 0x3E
_WS = frozenset(b" \n\r\t")
_NUM_START = frozenset(b"-0123456789")
_NUM = frozenset(b"-+.eE0123456789")
_LIT_START = frozenset(b"tfn")
_LIT = frozenset(b"abcdefghijklmnopqrstuvwxyz")

_CLASSES = (TagClass.PURE_SCAFFOLD, TagClass.FREE_GENERATION, TagClass.SCHEMA_BEARING)
_ROLES = (JsonRole.SCAFFOLD_SEPARATOR, JsonRole.OPTIONAL, JsonRole.REQUIRED, JsonRole.DISPATCH_KEY)
_CLS_IDX = [0 if b < 2 else 1 if b < 4 else 2 for b in range(8)]
_ROLE_IDX = [0 if b < 2 else 1 if b < 4 else 2 if b < 8 else 3 for b in range(16)]
_TAGS = [
    Tag(c, r, State.CRITICAL if k else State.BOUNDARY, Next.LOOKAHEAD_CRITICAL if la else Next.NO_LOOKAHEAD)
    for c in _CLASSES
    for r in _ROLES
    for k in (0, 1)
    for la in (0, 1)
]

# Schema keywords that change structure in ways this tagger does not follow.
_UNFOLLOWED = frozenset({"if", "then", "else", "dependentSchemas", "dependentRequired", "$dynamicRef", "$recursiveRef"})
_STRUCT_KEYS = frozenset(
    {
        "type",
        "properties",
        "required",
        "additionalProperties",
        "patternProperties",
        "items",
        "prefixItems",
        "enum",
        "const",
    }
)
_MAX_REF_DEPTH = 64
_MAX_NESTING = 256


def _encodings(name: str) -> set[bytes]:
    """How a key or name can appear between quotes: JSON-escaped ASCII or raw UTF-8."""
    return {json.dumps(name)[1:-1].encode(), json.dumps(name, ensure_ascii=False)[1:-1].encode()}


class _Node:
    """A compiled (merged) schema: what keys an object may have and what its children are."""

    __slots__ = (
        "_children",
        "_prefix",
        "any",
        "extra",
        "fallback",
        "items",
        "keys",
        "patterns",
        "prefix_items",
        "raws",
    )

    def __init__(self, fallback: bool = False) -> None:
        self.keys: dict[bytes, tuple[bool, str]] = {}  # encoding -> (required, name)
        self.raws: dict[str, list[tuple[Any, Any]]] = {}  # name -> [(schema, $ref root)]
        self.extra: list[tuple[Any, Any]] = []  # additionalProperties schemas
        self.patterns: list[tuple[re.Pattern, Any, Any]] = []
        self.items: list[tuple[Any, Any]] = []
        self.prefix_items: list[list[tuple[Any, Any]]] = []
        self.any = False
        self.fallback = fallback
        self._children: dict[object, _Node] = {}
        self._prefix: dict[bytes, int] = {}

    def prefix_role(self, prefix: bytes) -> int:
        """Role bit of a key known only by its first bytes."""
        r = self._prefix.get(prefix)
        if r is None:
            r = R_REQ if any(req for enc, (req, _) in self.keys.items() if enc.startswith(prefix)) else R_OPT
            if len(self._prefix) < 4096:
                self._prefix[prefix] = r
        return r

    def key(self, enc: bytes) -> tuple[int, _Node]:
        """(role bit, child schema) of a complete key."""
        if self.fallback:
            return R_OPT, _FB
        hit = self.keys.get(enc)
        if hit is not None:
            req, name = hit
            child = self._children.get(name)
            if child is None:
                child = self._children[name] = compile_schema(self.raws.get(name, []))
            return (R_REQ if req else R_OPT), child
        child = self._children.get(enc)
        if child is None:
            raws = list(self.extra)
            try:
                text = json.loads(b'"' + enc + b'"')
                raws += [(s, root) for pat, s, root in self.patterns if pat.search(text)]
            except ValueError:
                pass
            child = compile_schema(raws) if raws else _ANY
            if len(self._children) < 4096:
                self._children[enc] = child
        return R_OPT, child

    def item(self, index: int) -> _Node:
        """Schema of the array element at ``index``."""
        if self.fallback:
            return _FB
        slot: object = index if index < len(self.prefix_items) else "items"
        child = self._children.get(slot)
        if child is None:
            raws = self.prefix_items[index] if isinstance(slot, int) else self.items
            child = self._children[slot] = compile_schema(raws) if raws else _ANY
        return child


_ANY = _Node()
_ANY.any = True
_FB = _Node(fallback=True)
_CALL = _Node()  # sentinel: the {"name": ..., "arguments": ...} object


def walk_pointer(root: Any, parts: list[str], missing: Any = None) -> Any:
    """Follow the (still escaped) tokens of a JSON pointer from ``root``; ``missing`` when it dangles."""
    node = root
    for part in parts:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return missing
    return node


def _pointer(root: Any, ref: str) -> Any:
    """Resolve a local JSON pointer ``#/...``; ``_FB`` when it dangles."""
    return walk_pointer(root, ref[1:].split("/")[1:] if ref != "#" else [], _FB)


def _flatten(raw: Any, root: Any, seen: frozenset, out: list, cyc: list, depth: int) -> bool:
    """Expand $ref and combinators into concrete schemas; False when the schema cannot be followed."""
    if depth > _MAX_REF_DEPTH:
        return False
    if raw is True:
        out.append(({}, root))
        return True
    if not isinstance(raw, dict) or not _UNFOLLOWED.isdisjoint(raw):
        return False
    ref = raw.get("$ref")
    if ref is not None:
        if not isinstance(ref, str) or not ref.startswith("#"):
            return False
        if ref in seen:
            cyc.append(ref)
        else:
            target = _pointer(root, ref)
            if target is _FB or not _flatten(target, root, seen | {ref}, out, cyc, depth + 1):
                return False
    combos = False
    for kw in ("allOf", "anyOf", "oneOf"):
        subs = raw.get(kw)
        if subs is None:
            continue
        if not isinstance(subs, list):
            return False
        combos = True
        for sub in subs:
            if not _flatten(sub, root, seen, out, cyc, depth + 1):
                return False
    if (ref is None and not combos) or not _STRUCT_KEYS.isdisjoint(raw):
        out.append((raw, root))
    return True


def compile_schema(members: list[tuple[Any, Any]]) -> _Node:
    """Merge schemas ``[(schema, $ref root)]`` into one node (union of keys; required if any requires)."""
    concrete: list[tuple[dict, Any]] = []
    cyc: list[str] = []
    for raw, root in members:
        if not _flatten(raw, root, frozenset(), concrete, cyc, 0):
            return _FB
    if not concrete:
        return _FB if cyc else _ANY
    node = _Node()
    for raw, root in concrete:
        if _STRUCT_KEYS.isdisjoint(raw):
            node.any = True
        props = raw.get("properties", {})
        req = raw.get("required", [])
        items = raw.get("items")
        prefix = raw.get("prefixItems", [])
        if not isinstance(props, dict) or not isinstance(req, list) or not isinstance(prefix, list):
            return _FB
        for name, sub in props.items():
            _add_key(node, name, False)
            node.raws[name].append((sub, root))
        for name in req:
            if isinstance(name, str):
                _add_key(node, name, True)
        extra = raw.get("additionalProperties")
        if isinstance(extra, dict):
            node.extra.append((extra, root))
        pats = raw.get("patternProperties")
        if isinstance(pats, dict):
            for pat, sub in pats.items():
                try:
                    node.patterns.append((re.compile(pat), sub, root))
                except (re.error, TypeError):
                    continue
        if isinstance(items, list):  # draft-4 tuple form
            prefix = items
            items = raw.get("additionalItems")
        if isinstance(items, dict | bool):
            node.items.append((items, root))
        for i, sub in enumerate(prefix):
            if i == len(node.prefix_items):
                node.prefix_items.append([])
            node.prefix_items[i].append((sub, root))
    return node


def _add_key(node: _Node, name: str, required: bool) -> None:
    node.raws.setdefault(name, [])
    for enc in _encodings(name):
        old = node.keys.get(enc)
        node.keys[enc] = (required or (old is not None and old[0]), name)


def _tool_parts(tool: dict) -> tuple[str, Any]:
    fn = tool.get("function", tool) if isinstance(tool, dict) else {}
    return fn.get("name", ""), fn.get("parameters", {"type": "object", "properties": {}})


class JsonCallTagger:
    """Incremental (class, role, state, next) tagger for native tool-call output.

    ``tools`` are OpenAI-style tools (``{"type": "function", "function": {"name", "parameters"}}``)
    or bare function dicts with ``name`` and JSON Schema ``parameters``.
    """

    def __init__(self, tools: list[dict]) -> None:
        self._params: dict[bytes, tuple[Any, Any]] = {}
        self._nodes: dict[bytes, _Node] = {}
        for tool in tools or []:
            try:
                name, params = _tool_parts(tool)
            except AttributeError:
                continue
            if isinstance(name, str):
                for enc in _encodings(name):
                    self._params[enc] = (params, params)
        self._union: _Node | None = None
        self.reset()

    def reset(self) -> None:
        """Forget the output so far (start of a new response)."""
        self._st = S_TOP
        self._stack: list[list] = []  # [is_object, node, owner role bit, fallback, element index]
        self._buf = bytearray()  # key / function name / marker text being read
        self._esc = False
        self._vfirst = False  # the next string byte is a value's first byte
        self._vrole = R_SEP  # role bit of the value being read
        self._vnode: _Node = _ANY
        self._vfb = False
        self._vfn = False  # the value being read is the function name
        self._vfn_pending = False  # the key just closed is the call's "name"
        self._call_node: _Node | None = None  # parameters of the current call, once its name is read
        self._marker_close = False
        self._errtail = b""
        self.degraded = False

    # -- schema lookups -------------------------------------------------

    def _args_node(self) -> _Node:
        if self._call_node is not None:
            return self._call_node
        if self._union is None:
            self._union = compile_schema(list(self._params.values())) if self._params else _FB
        return self._union

    def _function_node(self, enc: bytes) -> _Node:
        node = self._nodes.get(enc)
        if node is None:
            hit = self._params.get(enc)
            node = compile_schema([hit]) if hit is not None else _FB
            self._nodes[enc] = node
        return node

    # -- stepping ---------------------------------------------------------

    def step(self, token_bytes: bytes) -> Tag:
        """Consume the bytes of one accepted token and return its tag."""
        try:
            return self._step(bytes(token_bytes))
        except Exception:  # an internal surprise must never stop decoding
            self._st = S_ERROR
            self._errtail = b""
            self.degraded = True
            return FALLBACK

    def _seek_open(self, data: bytes, start: int) -> int:
        """In the error state: index in ``data`` just after a ``<tool_call>`` marker, or -1."""
        tail = self._errtail
        hay = tail + data[start:]
        k = hay.find(OPEN_MARKER)
        if k < 0:
            self._errtail = hay[-(len(OPEN_MARKER) - 1) :]
            return -1
        self._errtail = b""
        return start + k + len(OPEN_MARKER) - len(tail)

    def _step(self, data: bytes) -> Tag:
        st = self._st
        fb = False
        i = 0
        if st == S_ERROR:
            i = self._seek_open(data, 0)
            if i < 0:
                return FALLBACK
            fb = not (i == len(OPEN_MARKER) and data.startswith(OPEN_MARKER))
            st = S_BODY
            self._stack.clear()
            self._esc = False
        stack = self._stack
        buf = self._buf
        esc = self._esc
        vfirst = self._vfirst
        vrole = self._vrole
        vfb = self._vfb
        cls = C_SCAF
        role = R_SEP
        crit = False
        keytok = False  # key text bytes seen in this token and not yet folded into ``role``
        curfb = bool(stack) and stack[-1][3]
        n = len(data)
        while i < n:
            b = data[i]
            i += 1
            if st == S_IN_STR:
                if esc:
                    esc = False
                elif b == QUOTE:
                    st = S_COMMA_OR_CLOSE
                elif b == BSLASH:
                    esc = True
                cls |= C_FREE
                role |= vrole
                if vfirst:
                    crit = True
                    vfirst = False
                if vfb:
                    fb = True
            elif st == S_IN_KEY:
                if esc:
                    esc = False
                    buf.append(b)
                elif b == QUOTE:
                    krole, node = self._close_key(bytes(buf))
                    if keytok:
                        role |= krole
                        keytok = False
                    vrole = krole
                    vfb = curfb or node.fallback
                    self._vnode = node
                    st = S_COLON
                    if curfb:
                        fb = True
                    continue
                else:
                    if b == BSLASH:
                        esc = True
                    buf.append(b)
                cls |= C_SCHEMA
                crit = True
                keytok = True
                if curfb:
                    fb = True
            elif st == S_VALUE:
                if b in _WS:
                    if curfb:
                        fb = True
                    continue
                if vfb:
                    fb = True
                if b == QUOTE:
                    if self._vfn:
                        st = S_IN_FNAME
                        buf.clear()
                    else:
                        st = S_IN_STR
                        vfirst = True
                elif b in (LBRACE, LBRACK):
                    if len(stack) >= _MAX_NESTING:
                        st, fb = self._error(), True
                        break
                    stack.append([b == LBRACE, self._vnode, vrole, vfb, 0])
                    curfb = vfb
                    st = S_KEY_OR_CLOSE if b == LBRACE else S_VAL_OR_CLOSE
                elif b in _NUM_START or b in _LIT_START:
                    st = S_IN_NUM if b in _NUM_START else S_IN_LIT
                    cls |= C_FREE
                    role |= vrole
                    crit = True
                else:
                    st, fb = self._error(), True
                    j = self._seek_open(data, i - 1)
                    if j < 0:
                        break
                    i, st = j, S_BODY
                    stack.clear()
                    curfb = False
            elif st in (S_COLON, S_COMMA_OR_CLOSE, S_KEY, S_KEY_OR_CLOSE):
                if b in _WS:
                    if curfb:
                        fb = True
                    continue
                if curfb:
                    fb = True
                if st == S_COLON:
                    ok = b == COLON
                    if ok:
                        st = S_VALUE
                        self._vfn = self._vfn_pending
                elif st == S_COMMA_OR_CLOSE:
                    top = stack[-1]
                    ok = True
                    if b == COMMA:
                        if top[0]:
                            st = S_KEY
                        else:
                            top[4] += 1
                            vrole, vfb = self._element(top)
                            st = S_VALUE
                    elif b == (RBRACE if top[0] else RBRACK):
                        stack.pop()
                        st = S_COMMA_OR_CLOSE if stack else S_AFTER_BODY
                        curfb = bool(stack) and stack[-1][3]
                    else:
                        ok = False
                elif b == QUOTE:  # S_KEY / S_KEY_OR_CLOSE
                    ok = True
                    st = S_IN_KEY
                    buf.clear()
                else:
                    ok = st == S_KEY_OR_CLOSE and b == RBRACE
                    if ok:
                        stack.pop()
                        st = S_COMMA_OR_CLOSE if stack else S_AFTER_BODY
                        curfb = bool(stack) and stack[-1][3]
                if not ok:
                    st, fb = self._error(), True
                    j = self._seek_open(data, i - 1)
                    if j < 0:
                        break
                    i, st = j, S_BODY
                    stack.clear()
                    curfb = False
            elif st == S_IN_FNAME:
                if esc:
                    esc = False
                    buf.append(b)
                elif b == QUOTE:
                    self._call_node = self._function_node(bytes(buf))
                    st = S_COMMA_OR_CLOSE
                else:
                    if b == BSLASH:
                        esc = True
                    buf.append(b)
                cls |= C_SCHEMA
                role |= R_DISP
                crit = True
            elif st in (S_IN_NUM, S_IN_LIT):
                if b in (_NUM if st == S_IN_NUM else _LIT):
                    cls |= C_FREE
                    role |= vrole
                    if vfb:
                        fb = True
                else:
                    st = S_COMMA_OR_CLOSE
                    i -= 1  # re-read the byte after the scalar
            elif st == S_VAL_OR_CLOSE:
                top = stack[-1]
                if b in _WS:
                    if curfb:
                        fb = True
                elif b == RBRACK:
                    if curfb:
                        fb = True
                    stack.pop()
                    st = S_COMMA_OR_CLOSE if stack else S_AFTER_BODY
                    curfb = bool(stack) and stack[-1][3]
                else:
                    vrole, vfb = self._element(top)
                    st = S_VALUE
                    i -= 1
            elif st == S_MARKER:
                buf.append(b)
                if b == GT:
                    m = bytes(buf)
                    if self._marker_close:
                        ok, st = m == CLOSE_MARKER, S_TOP
                    elif m == OPEN_MARKER:
                        ok, st = True, S_BODY
                    else:
                        ok, st = m.startswith(b"<|") and m.endswith(b"|>"), S_TOP
                elif len(buf) > 32:
                    ok = False
                else:
                    continue
                if not ok:
                    st, fb = self._error(), True
                    j = self._seek_open(data, i)
                    if j < 0:
                        break
                    i, st = j, S_BODY
                    stack.clear()
            elif b in _WS:  # S_TOP, S_BODY, S_AFTER_BODY
                continue
            elif b == LT and st != S_BODY:
                self._marker_close = st == S_AFTER_BODY
                st = S_MARKER
                buf.clear()
                buf.append(b)
            elif b == LBRACE and st in (S_BODY, S_TOP):  # S_TOP: a later call without its opening marker
                stack.append([True, _CALL, R_SEP, False, 0])
                self._call_node = None
                curfb = False
                st = S_KEY_OR_CLOSE
            else:
                st, fb = self._error(), True
                j = self._seek_open(data, i - 1)
                if j < 0:
                    break
                i, st = j, S_BODY
                stack.clear()
                curfb = False
        if keytok and st == S_IN_KEY:
            top = stack[-1][1]
            role |= _call_prefix_role(buf) if top is _CALL else top.prefix_role(bytes(buf))
        self._st = st
        self._esc = esc
        self._vfirst = vfirst
        self._vrole = vrole
        self._vfb = vfb
        if fb:
            self.degraded = True
            return FALLBACK
        la = st in _LA_STATES or (st == S_IN_STR and vfirst)
        return _TAGS[((_CLS_IDX[cls] * 4 + _ROLE_IDX[role]) * 2 + crit) * 2 + la]

    def _error(self) -> int:
        self.degraded = True
        self._errtail = b""
        return S_ERROR

    def _close_key(self, enc: bytes) -> tuple[int, _Node]:
        """Role bit and value schema of a complete key in the innermost object."""
        node = self._stack[-1][1]
        self._vfn_pending = False
        if node is _CALL:
            if enc == b"name":
                self._vfn_pending = True
                return R_DISP, _ANY
            if enc == b"arguments":
                return R_REQ, self._args_node()
            return R_OPT, _ANY
        return node.key(enc)

    def _element(self, top: list) -> tuple[int, bool]:
        """Set up the value context of the next element of array frame ``top``."""
        node = top[1].item(top[4])
        self._vnode = node
        self._vfn = False
        return top[2], top[3] or node.fallback


def _call_prefix_role(prefix: bytearray) -> int:
    if b"name".startswith(prefix):
        return R_DISP
    if b"arguments".startswith(prefix):
        return R_REQ
    return R_OPT
