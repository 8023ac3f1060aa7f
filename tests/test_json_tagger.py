"""JSON tool-call tagger: property tests against an independent reference labeller.

The reference writes the calls itself (in json.dumps' default style), recording
for every byte what it is (structure, key text, function name, value) from the
known instance; a token's expected tag is the priority combination over its
bytes. Tokens come from the real Qwen tokenizer, their bytes from llguidance
(special tokens as their text), exactly as the engine feeds them.
"""

from __future__ import annotations

import json
import unicodedata
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pask.structure.constraint import ll_tokenizer
from pask.structure.json_tagger import JsonCallTagger
from pask.structure.tags import (
    CLASS_PRIORITY,
    FALLBACK,
    ROLE_PRIORITY,
    Bucket,
    JsonRole,
    Next,
    State,
    Tag,
    TagClass,
    json_tags,
)

SCAF, FREE, SCHEMA = TagClass.PURE_SCAFFOLD, TagClass.FREE_GENERATION, TagClass.SCHEMA_BEARING
SEP, OPT, REQ, DISP = JsonRole.SCAFFOLD_SEPARATOR, JsonRole.OPTIONAL, JsonRole.REQUIRED, JsonRole.DISPATCH_KEY
ALL_TAGS = frozenset(json_tags())


@pytest.fixture(scope="module")
def enc(qwen_tokenizer):
    """text -> list of token bytes, as the engine would feed them."""
    ll = ll_tokenizer(qwen_tokenizer, [qwen_tokenizer.eos_token_id])

    def encode(text: str) -> list[bytes]:
        ids = qwen_tokenizer(text, add_special_tokens=False)["input_ids"]
        out = [ll.decode_bytes([i]) for i in ids]
        assert b"".join(out) == text.encode()
        return out

    return encode


# -- reference labeller ------------------------------------------------------------


@dataclass
class _Key:
    start: int  # first byte of the key text
    end: int  # index of the closing quote
    roles: dict[bytes, JsonRole]  # candidate keys of the object -> role


@dataclass
class Ref:
    """Bytes of an output with, per byte, (class, role or a _Key, critical) and the lookahead positions."""

    out: bytearray = field(default_factory=bytearray)
    marks: list = field(default_factory=list)
    la: set[int] = field(default_factory=set)

    def put(self, data: bytes, cls=SCAF, role=SEP, crit=False) -> None:
        for k, b in enumerate(data):
            self.out.append(b)
            self.marks.append((cls, role, crit and k == 0))

    def la_here(self) -> None:
        self.la.add(len(self.out))

    def key(self, name: str, roles: dict[bytes, JsonRole]) -> None:
        text = json.dumps(name, ensure_ascii=False).encode()[1:-1]
        self.put(b'"')
        k = _Key(len(self.out), len(self.out) + len(text), roles)
        for p in range(k.start, k.end + 1):
            self.la.add(p)  # inside the key until its closing quote
        for b in text:
            self.out.append(b)
            self.marks.append((SCHEMA, k, True))
        self.put(b'"')
        self.put(b":")
        self.la_here()
        self.put(b" ")
        self.la_here()

    def string(self, value: str, cls: TagClass, role: JsonRole, all_critical: bool = False) -> None:
        text = json.dumps(value, ensure_ascii=False).encode()
        self.put(b'"')
        self.la_here()
        if all_critical:
            for p in range(len(self.out), len(self.out) + len(text) - 1):
                self.la.add(p)
        for k, b in enumerate(text[1:]):
            self.out.append(b)
            self.marks.append((cls, role, all_critical or k == 0))

    def tag(self, s: int, e: int) -> Tag:
        cls, role, crit = SCAF, SEP, False
        for p in range(s, e):
            c, r, k = self.marks[p]
            if isinstance(r, _Key):
                if e > r.end:  # closing quote in the token: the exact key decides
                    r = r.roles.get(bytes(self.out[r.start : r.end]), OPT)
                else:
                    prefix = bytes(self.out[r.start : e])
                    hits = [v for name, v in r.roles.items() if name.startswith(prefix)]
                    r = max(hits, key=ROLE_PRIORITY.__getitem__, default=OPT)
            cls = max(cls, c, key=CLASS_PRIORITY.__getitem__)
            role = max(role, r, key=ROLE_PRIORITY.__getitem__)
            crit = crit or k
        la = Next.LOOKAHEAD_CRITICAL if e in self.la else Next.NO_LOOKAHEAD
        return Tag(cls, role, State.CRITICAL if crit else State.BOUNDARY, la)


def _props(schema: dict) -> tuple[dict, set]:
    return schema.get("properties", {}), set(schema.get("required", []))


def emit_value(r: Ref, schema: dict, value, role: JsonRole) -> None:
    if isinstance(value, dict):
        props, req = _props(schema)
        roles = {json.dumps(k, ensure_ascii=False).encode()[1:-1]: (REQ if k in req else OPT) for k in props}
        r.put(b"{")
        r.la_here()
        for i, (k, v) in enumerate(value.items()):
            if i:
                r.put(b",")
                r.la_here()
                r.put(b" ")
                r.la_here()
            r.key(k, roles)
            emit_value(r, props.get(k, {}), v, REQ if k in req else OPT)
        r.put(b"}")
    elif isinstance(value, list):
        items = schema.get("items", {})
        r.put(b"[")
        r.la_here()
        for i, v in enumerate(value):
            if i:
                r.put(b",")
                r.la_here()
                r.put(b" ")
                r.la_here()
            emit_value(r, items, v, role)
        r.put(b"]")
    elif isinstance(value, str):
        r.string(value, FREE, role)
    else:
        r.put(json.dumps(value).encode(), FREE, role, crit=True)


CALL_ROLES = {b"name": DISP, b"arguments": REQ}


def emit_calls(calls: list[tuple[str, dict]], tools: list[dict]) -> Ref:
    params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    r = Ref()
    for i, (name, args) in enumerate(calls):
        if i:
            r.put(b"\n")
        r.put(b"<tool_call>\n{")
        r.la_here()
        r.key("name", CALL_ROLES)
        r.string(name, SCHEMA, DISP, all_critical=True)
        r.put(b",")
        r.la_here()
        r.put(b" ")
        r.la_here()
        r.key("arguments", CALL_ROLES)
        emit_value(r, params[name], args, REQ)
        r.put(b"}\n</tool_call>")
    return r


def expected_text(calls: list[tuple[str, dict]]) -> str:
    blocks = [json.dumps({"name": n, "arguments": a}, ensure_ascii=False) for n, a in calls]
    return "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in blocks)


def run(tagger: JsonCallTagger, pieces: list[bytes]) -> list[Tag]:
    tagger.reset()
    return [tagger.step(p) for p in pieces]


def check(enc, tools, calls, trailing: str = "") -> None:
    ref = emit_calls(calls, tools)
    text = expected_text(calls)
    assert ref.out.decode() == text
    pieces = enc(text + trailing)
    tagger = JsonCallTagger(tools)
    tags = run(tagger, pieces)
    pos = 0
    for piece, tag in zip(pieces, tags, strict=True):
        end = pos + len(piece)
        want = ref.tag(pos, min(end, len(ref.out))) if pos < len(ref.out) else None
        if want is not None:
            assert tag == want, f"token {piece!r} at {pos} of {text!r}"
        assert tag in ALL_TAGS
        assert Bucket.parse(str(Bucket(tag, 1))) == Bucket(tag, 1)
        pos = end
    assert not tagger.degraded  # FALLBACK equals a required key's tag, so check the flag


# -- strategies ------------------------------------------------------------------

KEY_NAMES = st.text(alphabet="ab_1", min_size=1, max_size=4)  # shared prefixes on purpose
FN_NAMES = st.text(alphabet="fg_2", min_size=1, max_size=5)
TEXT = st.text(
    st.one_of(st.sampled_from(list('a "\\\n\t/<>é中😀')), st.characters(blacklist_categories=("Cs",))),
    max_size=8,
).map(lambda s: unicodedata.normalize("NFC", s))
SCALARS = st.sampled_from(
    [{"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}, {}, {"type": "null"}]
) | st.lists(st.text(alphabet="xyz ", min_size=1, max_size=3), min_size=1, max_size=3, unique=True).map(
    lambda e: {"type": "string", "enum": e}
)


def objects(sub):
    def with_required(props):
        return st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda req: {"type": "object", "properties": props, "required": req, "additionalProperties": False}
        )

    return st.dictionaries(KEY_NAMES, sub, max_size=4).flatmap(
        lambda props: with_required(props) if props else st.just({"type": "object", "properties": {}})
    )


SCHEMAS = st.recursive(
    SCALARS, lambda sub: objects(sub) | sub.map(lambda s: {"type": "array", "items": s}), max_leaves=6
)
ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.floats(allow_nan=False, allow_infinity=False) | TEXT,
    lambda sub: st.lists(sub, max_size=3) | st.dictionaries(KEY_NAMES, sub, max_size=3),
    max_leaves=4,
)


def draw_value(draw, schema: dict):
    """A value valid for ``schema`` (the generator's subset of JSON Schema)."""
    t = schema.get("type")
    if "enum" in schema:
        return draw(st.sampled_from(schema["enum"]))
    if t == "object":
        props, req = _props(schema)
        keys = sorted(req) + [k for k in sorted(props) if k not in req and draw(st.booleans())]
        return {k: draw_value(draw, props[k]) for k in draw(st.permutations(keys))}
    if t == "array":
        return [draw_value(draw, schema["items"]) for _ in range(draw(st.integers(0, 3)))]
    strategy = {
        "string": TEXT,
        "integer": st.integers(-(10**9), 10**9),
        "number": st.floats(allow_nan=False, allow_infinity=False) | st.integers(-99, 99),
        "boolean": st.booleans(),
        "null": st.none(),
    }.get(t, ANY_JSON)
    return draw(strategy)


@st.composite
def tools_and_calls(draw):
    """1-3 tools with random parameter schemas and 1-3 valid calls of them."""
    names = draw(st.lists(FN_NAMES, min_size=1, max_size=3, unique=True))
    tools = [_tool(name, draw(objects(SCHEMAS))) for name in names]
    calls = []
    for _ in range(draw(st.integers(1, 3))):
        fn = draw(st.sampled_from(tools))["function"]
        calls.append((fn["name"], draw_value(draw, fn["parameters"])))
    return tools, calls


def _tool(name: str, params) -> dict:
    return {"type": "function", "function": {"name": name, "description": "", "parameters": params}}


FAST = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(tc=tools_and_calls(), trailing=st.sampled_from(["", "\n", "\n<|im_end|>"]))
def test_tags_match_reference(enc, tc, trailing):
    tools, calls = tc
    check(enc, tools, calls, trailing)


@FAST
@given(tc=tools_and_calls(), garbage=st.lists(st.binary(max_size=6), max_size=6), cut=st.integers(0, 10**6))
def test_never_raises_on_garbage(enc, tc, garbage, cut):
    tools, calls = tc
    pieces = enc(expected_text(calls))
    cut %= len(pieces) + 1
    tagger = JsonCallTagger(tools)
    for p in [*pieces[:cut], *garbage, *pieces[cut:]]:
        assert tagger.step(p) in ALL_TAGS
    tagger = JsonCallTagger(tools)
    for p in garbage:
        assert tagger.step(p) in ALL_TAGS


# -- hand-written cases ------------------------------------------------------------


def test_qwen_call_tags(enc):
    tools = [
        _tool(
            "get_weather",
            {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        )
    ]
    pieces = enc('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>')
    tags = dict(zip(pieces, run(JsonCallTagger(tools), pieces), strict=False))
    assert tags[b"<tool_call>"] == Tag(SCAF, SEP, State.BOUNDARY, Next.NO_LOOKAHEAD)
    assert tags[b"name"] == Tag(SCHEMA, DISP, State.CRITICAL, Next.LOOKAHEAD_CRITICAL)
    assert tags[b"arguments"] == Tag(SCHEMA, REQ, State.CRITICAL, Next.LOOKAHEAD_CRITICAL)
    assert tags[b"city"] == Tag(SCHEMA, REQ, State.CRITICAL, Next.LOOKAHEAD_CRITICAL)
    assert tags[b"days"] == Tag(SCHEMA, OPT, State.CRITICAL, Next.LOOKAHEAD_CRITICAL)
    assert tags[b"3"] == Tag(FREE, OPT, State.CRITICAL, Next.NO_LOOKAHEAD)
    assert tags[b'":'] == Tag(SCAF, SEP, State.BOUNDARY, Next.LOOKAHEAD_CRITICAL)
    assert tags[b"</tool_call>"] == Tag(SCAF, SEP, State.BOUNDARY, Next.NO_LOOKAHEAD)


def test_partial_key_resolution():
    params = {
        "type": "object",
        "properties": {"fmt": {"type": "string"}, "fmt_all": {"type": "string"}, "zz": {"type": "integer"}},
        "required": ["fmt_all"],
    }
    t = JsonCallTagger([_tool("f", params)])
    for p in [b"<tool_call>", b"\n", b'{"', b"name", b'": "', b"f", b'", "', b"arguments", b'": {"']:
        t.step(p)
    assert t.step(b"fm").role == REQ  # fmt or fmt_all: one of them is required
    assert t.step(b't":').role == OPT  # closed: exactly "fmt"
    assert t.step(b' "x", "').role == OPT  # value of the optional key
    assert t.step(b"z").role == OPT
    assert t.step(b'z": 1, "fmt_').role == REQ
    assert not t.degraded


def test_nested_schema_roles(enc):
    params = {
        "type": "object",
        "properties": {
            "conds": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"field": {"type": "string"}, "note": {"type": "string"}},
                    "required": ["field"],
                },
            },
            "extra": {"type": "object", "properties": {"deep": {"type": "integer"}}, "required": ["deep"]},
        },
        "required": ["conds"],
    }
    tools = [_tool("query", params)]
    calls = [("query", {"conds": [{"field": "age", "note": "n"}, {"field": "job"}], "extra": {"deep": 4}})]
    check(enc, tools, calls)
    text = expected_text(calls)
    pieces = enc(text)
    tags = run(JsonCallTagger(tools), pieces)
    by = {}
    for p, t in zip(pieces, tags, strict=True):
        by.setdefault(p, t)
    assert by[b"field"].role == REQ and by[b"note"].role == OPT  # by the nested schema
    assert by[b"deep"].role == REQ  # required inside an optional object


def test_ref_cycle_falls_back_without_crashing():
    params = {
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/x"}, "b": {"type": "string"}},
        "required": ["a", "b"],
        "$defs": {"x": {"$ref": "#/$defs/y"}, "y": {"$ref": "#/$defs/x"}},
    }
    t = JsonCallTagger([_tool("f", params)])
    head = [b"<tool_call>", b"\n", b'{"', b"name", b'": "', b"f", b'", "', b"arguments", b'": {"']
    for p in head:
        t.step(p)
    assert not t.degraded  # (FALLBACK equals a required key's tag, so compare the flag here)
    assert t.step(b"a").role == REQ
    assert t.step(b'": ') != FALLBACK
    assert [t.step(p) for p in [b'{"', b"k", b'": ', b"1", b"}"]] == [FALLBACK] * 5
    assert t.degraded
    assert t.step(b', "') == Tag(SCAF, SEP, State.BOUNDARY, Next.LOOKAHEAD_CRITICAL)
    assert t.step(b"b") == Tag(SCHEMA, REQ, State.CRITICAL, Next.LOOKAHEAD_CRITICAL)
    assert t.step(b'": "') != FALLBACK
    assert t.step(b"s") == Tag(FREE, REQ, State.CRITICAL, Next.NO_LOOKAHEAD)
    assert t.step(b'"}}\n') == Tag(FREE, REQ, State.BOUNDARY, Next.NO_LOOKAHEAD)
    assert t.step(b"</tool_call>") == Tag(SCAF, SEP, State.BOUNDARY, Next.NO_LOOKAHEAD)


@pytest.mark.parametrize(
    "params",
    [
        {"$ref": "#"},  # the parameters themselves are a pure cycle
        {"$ref": "http://example.com/schema.json"},
        {"$ref": "#/$defs/missing"},
        {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}},
        "not a schema",
        None,
    ],
)
def test_unfollowable_parameters(params):
    t = JsonCallTagger([_tool("f", params)])
    tags = [t.step(p) for p in [b"<tool_call>", b'\n{"name": "f", "arguments": ', b'{"', b"a", b'": ', b"1", b"}"]]
    assert tags[2:] == [FALLBACK] * 5
    assert t.step(b"}\n</tool_call>") != FALLBACK


def test_recursive_schema_is_followed():
    params = {
        "type": "object",
        "properties": {"tree": {"$ref": "#/$defs/node"}},
        "required": ["tree"],
        "$defs": {
            "node": {
                "type": "object",
                "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
                "required": ["v"],
            }
        },
    }
    t = JsonCallTagger([_tool("walk", params)])
    t.step(b'<tool_call>\n{"name": "walk", "arguments": {"tree": {"')
    for _ in range(3):  # three levels deep
        assert t.step(b"v").role == REQ
        assert t.step(b'": 1, "').role == REQ
        assert t.step(b"kids").role == OPT
        assert t.step(b'": [{"') != FALLBACK
    assert t.step(b"v") == Tag(SCHEMA, REQ, State.CRITICAL, Next.LOOKAHEAD_CRITICAL)
    assert t.step(b'": 2}]}]}]}}}\n</tool_call>') != FALLBACK
    assert not t.degraded


def test_unknown_function_and_union():
    params = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    t = JsonCallTagger([_tool("f", params), _tool("g", {"type": "object", "properties": {"y": {}}})])
    t.step(b'<tool_call>\n{"name": "h", "arguments": ')
    assert t.step(b'{"') == FALLBACK  # unknown function: its arguments cannot be followed
    t.reset()
    t.step(b'<tool_call>\n{"arguments": {"')
    assert t.step(b"x").role == REQ  # name not yet known: union of the tools
    assert t.step(b'": 1, "').role == REQ  # the value of x
    assert t.step(b"y").role == OPT


def test_garbage_then_resync(enc):
    tools = [_tool("f", {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]})]
    calls = [("f", {"a": "x"})]
    t = JsonCallTagger(tools)
    assert t.step(b"hello {") == FALLBACK
    assert t.degraded
    assert t.step(b"\n") == FALLBACK
    ref = emit_calls(calls, tools)
    pos = 0
    for piece in enc(expected_text(calls)):
        assert t.step(piece) == ref.tag(pos, pos + len(piece))
        pos += len(piece)


def test_odd_inputs_never_raise():
    for tools in ([], None, [None, 3, "x", {"function": None}], [{"name": "f"}]):
        t = JsonCallTagger(tools)  # type: ignore[arg-type]
        for p in [b"", b"<tool_call>", b"\n", b'{"name": "f", "arguments": {"a": [1, {"b": null}]}}', b"\xff\xfe"]:
            assert t.step(p) in ALL_TAGS
    t = JsonCallTagger([_tool("f", {"type": "object"})])
    assert t.step(b"") == Tag(SCAF, SEP, State.BOUNDARY, Next.NO_LOOKAHEAD)
    assert t.step(b"<|im_end|>") == Tag(SCAF, SEP, State.BOUNDARY, Next.NO_LOOKAHEAD)
    deep = b'<tool_call>\n{"name": "f", "arguments": {"a": ' + b"[" * 5000
    assert t.step(deep) == FALLBACK


def test_bare_function_dicts_and_pretty_whitespace():
    fn = {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}}
    t = JsonCallTagger([fn])
    tags = [t.step(p) for p in [b"<tool_call>\n", b'{ "name" : "f" ,\n "arguments" : { "', b"a", b'" : "v" } }\n']]
    assert tags[2] == Tag(SCHEMA, REQ, State.CRITICAL, Next.LOOKAHEAD_CRITICAL)
    assert t.step(b"</tool_call>") == Tag(SCAF, SEP, State.BOUNDARY, Next.NO_LOOKAHEAD)
    assert not t.degraded


def test_later_call_without_opening_marker(enc):
    """The grammar lets a later call start with its JSON directly after "</tool_call>\\n"."""
    tools = [_tool("f", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})]
    text = (
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
        '{"name": "f", "arguments": {"a": 2}}\n</tool_call>\n'
    )
    tagger = JsonCallTagger(tools)
    pieces = enc(text)
    tags = run(tagger, pieces)
    assert not tagger.degraded  # FALLBACK equals a required key's tag, so check the flag
    second = [t for p, t in zip(pieces, tags, strict=True) if p == b"name"]
    assert len(second) == 2 and all(t.role == DISP for t in second)
