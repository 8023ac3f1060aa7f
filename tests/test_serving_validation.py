"""Request validation of ``pask serve`` (docs/serving.md, "Request validation"): typed request models,
schemas checked and grammars compiled before admission.

A bad request is a 400 naming its parameter, never a 500, and never an error inside the decode loop
(where it would end every request in flight): ``$ref`` cycles that no finite value ends, wrong
inner types, schemas nested too deep, lone surrogates. Hypothesis mutates valid bodies at every
level and checks the same, and generates recursive schemas: each is refused or decodes.
"""

from __future__ import annotations

import copy
import json
import threading
import time

import httpx2 as httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pask.policies import FullPolicy
from pask.serving.protocol import MAX_JSON_DEPTH, ChatRequest, RequestError, build_chat_request, parse_body
from pask.structure.schema_check import MAX_SCHEMA_DEPTH

MODEL = "smollm2-135m"
JSON = {"content-type": "application/json"}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
# decodes for a while: the request in flight while a bad one arrives
STORY = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 16}


def _rf(schema: dict) -> dict:
    return {
        "model": MODEL,
        "messages": ASK,
        "response_format": {"type": "json_schema", "json_schema": {"schema": schema}},
    }


def _tool(params: dict, choice: str = "required") -> dict:
    tool = {"type": "function", "function": {"name": "f", "parameters": params}}
    return {"model": MODEL, "messages": ASK, "tools": [tool], "tool_choice": choice}


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


SELF = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
A_B_A = {
    "$defs": {
        "a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
        "b": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]},
    },
    "$ref": "#/$defs/a",
}
TREE = {  # recursion that can stop: children are optional (and may be empty)
    "type": "object",
    "properties": {"v": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
    "required": ["v"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(smol):
    """The app on a loopback port (uvicorn in a thread), Full KV."""
    from pask.serving.server import Service, serve_in_thread

    service = Service.build(smol, FullPolicy, capacity_tokens=4096, default_max_tokens=16)
    with serve_in_thread(service, start_timeout=30) as url:
        yield url, service


def _post(url: str, body: dict | bytes, timeout: float = 120) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{url}/v1/chat/completions", content=data, headers=JSON, timeout=timeout)


def _refused(r: httpx.Response, param: str | None = None) -> dict:
    """The error of a 400 in OpenAI's shape, without llguidance's internals."""
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert "<state>" not in err["message"] and "Parser" not in err["message"] and len(err["message"]) < 600
    if param is not None:
        assert err["param"] == param, err
    return err


# -- defect: a $ref cycle failed every request in flight ----------------------------------------
CYCLES = {
    "response_format, a required self-reference": (_rf(SELF), "response_format"),
    "response_format, a -> b -> a through $defs": (_rf(A_B_A), "response_format"),
    # a parameters schema without "type" is an object all the same: its required self-reference never ends
    "tool, a required self-reference": (_tool({"properties": {"a": {"$ref": "#"}}, "required": ["a"]}), "tools"),
    "tool, a -> b -> a through $defs": (_tool({"type": "object", **A_B_A}), "tools"),
}


@pytest.mark.parametrize("case", list(CYCLES))
def test_a_ref_cycle_is_its_own_400_and_spares_the_requests_in_flight(server, case):
    """Before: it passed validation, then failed inside the decode loop ("Too many items (limit
    50000)", "grammar error ...") and every request in flight got that 500; a tool's $defs failed
    with llguidance's source position and pointer; a typeless tool schema let the arguments be a string."""
    url, service = server
    body, param = CYCLES[case]
    answers: list[httpx.Response] = []
    other = threading.Thread(target=lambda: answers.append(_post(url, STORY)))
    other.start()
    deadline = time.time() + 60
    while not service.metrics.gauges.get("running") and other.is_alive() and time.time() < deadline:
        time.sleep(0.02)  # the story is decoding
    err = _refused(_post(url, {**body, "max_tokens": 16}), param)
    assert "recurses without end" in err["message"]
    other.join(120)
    (story,) = answers
    assert story.status_code == 200, story.text
    assert story.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_recursion_that_can_stop_is_served(server):
    """A tree with optional children: allowed, decoded, valid (llguidance handles it)."""
    url, _ = server
    body = {**_rf(TREE), "messages": [{"role": "user", "content": "A small tree of numbers as JSON."}]}
    r = _post(url, {**body, "max_tokens": 32})
    assert r.status_code == 200, r.text
    out = r.json()["choices"][0]
    if out["finish_reason"] == "stop":
        jsonschema.validate(json.loads(out["message"]["content"]), TREE)


def test_tool_parameters_with_defs_resolve_inside_the_call(server):
    """``#/$defs/...`` in a tool's parameters means the parameters (before: a pointer error, a 400)."""
    url, _ = server
    params = {
        "type": "object",
        "$defs": {"city": {"type": "string", "maxLength": 20}},
        "properties": {"city": {"$ref": "#/$defs/city"}},
        "required": ["city"],
        "additionalProperties": False,
    }
    r = _post(url, {**_tool(params), "max_tokens": 32})
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    if r.json()["choices"][0]["finish_reason"] == "tool_calls":
        jsonschema.validate(json.loads(msg["tool_calls"][0]["function"]["arguments"]), params)


# -- defect: wrong inner types were a 500 --------------------------------------------------------
BODY = {"model": MODEL, "messages": ASK}
WRONG = {
    "a text part's text is a number": (
        {**BODY, "messages": [{"role": "user", "content": [{"type": "text", "text": 42}]}]},
        "messages[0].content[0].text",
    ),
    "tool_calls is a number": (
        {**BODY, "messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": 5}]},
        "messages[1].tool_calls",
    ),
    "a tool call's function is a string": (
        {**BODY, "messages": [*ASK, {"role": "assistant", "tool_calls": [{"function": "x"}]}]},
        "messages[1].tool_calls[0].function",
    ),
    "tool_choice.function is a string": (
        {**BODY, "tools": [WEATHER], "tool_choice": {"type": "function", "function": "get_weather"}},
        "tool_choice.function",
    ),
    "a response_format schema nested 200 deep": (_rf(_nested(200)), None),
    "a tool schema nested 200 deep": (_tool(_nested(200)), None),
    "a schema nested past the schema depth limit": (
        _rf(_nested(MAX_SCHEMA_DEPTH + 1)),
        "response_format.json_schema.schema",
    ),
    "a lone surrogate in content": (
        {**BODY, "messages": [{"role": "user", "content": "a\ud800b"}]},
        "messages[0].content",
    ),
}


@pytest.mark.parametrize("case", list(WRONG))
def test_wrong_inner_types_are_a_400_naming_the_parameter(server, case):
    """Before: TypeError, AttributeError or RecursionError in protocol.py, a 500."""
    url, _ = server
    body, param = WRONG[case]
    err = _refused(_post(url, body), param)
    assert err["param"], err
    assert _post(url, {**BODY, "max_tokens": 1}).status_code == 200  # the server goes on


def test_bodies_that_do_not_parse_are_a_400():
    """Nesting past Python's recursion limit, NaN and over-long integers are malformed JSON, not a 500."""
    for raw in (b"[" * 100_000, b'{"model": NaN}', b'{"n": 1' + b"0" * 5000 + b"}", b'{"a": "\xff"}'):
        with pytest.raises(RequestError, match="malformed JSON") as e:
            parse_body(raw)
        assert e.value.status == 400


# -- the typed fields: sampling, strict types ----------------------------------------------------
SAMPLING_BAD = {
    "temperature": [2.5, -0.1, "0.5", True],
    "top_p": [0, 1.5, "1", -0.5],
    "seed": [-1, 2**64, 1.5, "7", False],
    "max_tokens": [0, -1, 2.0, "8", True],
    "stream": ["yes", 1],
    "n": [2, "1"],
}


@pytest.mark.parametrize("key", list(SAMPLING_BAD))
def test_out_of_range_or_mistyped_fields_are_a_400_naming_them(smol, key):
    for value in SAMPLING_BAD[key]:
        with pytest.raises(RequestError) as e:
            build_chat_request({**BODY, key: value}, smol.tokenizer, MODEL)
        assert e.value.status == 400 and e.value.param == key, (value, str(e.value))


def test_sampling_fields_reach_the_engine_request(smol):
    from dataclasses import fields

    from pask.runtime.tokens import Request

    chat = build_chat_request({**BODY, "temperature": 0.7, "top_p": 0.9, "seed": 11}, smol.tokenizer, MODEL)
    if "temperature" in {f.name for f in fields(Request)}:
        r = chat.request
        assert (r.temperature, r.top_p, r.seed) == (0.7, 0.9, 11)
    greedy = build_chat_request({**BODY, "temperature": None, "user": "x", "logprobs": False}, smol.tokenizer, MODEL)
    assert getattr(greedy.request, "temperature", 0.0) == 0.0  # absent or null: the runtime's default


# -- hypothesis: malformed types at every level --------------------------------------------------
VALID = [
    {**BODY, "max_tokens": 2},
    {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_completion_tokens": 2,
        "stream_options": {"include_usage": True},
        "temperature": 0.5,
        "top_p": 0.9,
        "seed": 3,
    },
    {**_rf(TREE), "max_tokens": 2, "stop": None, "n": 1},
    {**_tool(WEATHER["function"]["parameters"], "auto"), "max_tokens": 2},
]
LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6)
    | st.sampled_from(["", "text", "function", "object", "#", "#/$defs/x", "auto", "json_schema", "\ud800"])
)
VALUES = st.recursive(
    LEAVES,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


def _paths(node, at=()) -> list[tuple]:
    """Every location in a JSON value (the root included)."""
    out = [at]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*at, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*at, i))
    return out


@st.composite
def mutated_bodies(draw) -> dict:
    """A valid body with one location replaced by a random JSON value, deleted, or given an extra key."""
    body = copy.deepcopy(draw(st.sampled_from(VALID)))
    for _ in range(draw(st.integers(1, 2))):
        at = draw(st.sampled_from(_paths(body)))
        if not at:
            body = draw(VALUES)
            if not isinstance(body, dict):
                return body
            continue
        parent = body
        for key in at[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["replace", "replace", "delete", "extra"]))
        if action == "replace":
            parent[at[-1]] = draw(VALUES)
        elif action == "delete":
            del parent[at[-1]]
        elif isinstance(parent[at[-1]], dict):
            parent[at[-1]][draw(st.text(max_size=6))] = draw(VALUES)
    return body


def _answerable(e: RequestError) -> None:
    """A refusal the server can send: 400 / 404, a body JSONResponse can encode."""
    assert e.status in (400, 404)
    body = e.body()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    json.dumps(body, ensure_ascii=False, allow_nan=False).encode("utf-8")


def test_mutated_bodies_validate_or_get_a_4xx(smol):
    """build_chat_request raises only RequestError (never TypeError, AttributeError, RecursionError...)."""

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(mutated_bodies())
    def check(body):
        try:
            chat = build_chat_request(body, smol.tokenizer, MODEL, default_max_tokens=2)
        except RequestError as e:
            _answerable(e)
        else:
            assert isinstance(chat, ChatRequest) and chat.request.prompt_ids

    check()


@settings(max_examples=200, deadline=None, database=None)
@given(st.binary(max_size=64) | st.text(max_size=64).map(lambda t: t.encode("utf-8", "surrogatepass")))
def test_arbitrary_bytes_parse_or_get_a_400(raw):
    try:
        body = parse_body(raw)
    except RequestError as e:
        _answerable(e)
    else:
        assert isinstance(body, dict)


FUZZ_REQUESTS = 500  # issue 27: >= 500 generated requests over HTTP, 0 responses >= 500


@st.composite
def fuzz_requests(draw) -> tuple[bytes, dict]:
    """A generated request: a mutated body (JSON), or raw bytes, sometimes with a bad Content-Type."""
    if draw(st.integers(0, 9)) == 0:
        raw = draw(st.binary(max_size=64) | st.text(max_size=64).map(lambda t: t.encode("utf-8", "surrogatepass")))
    else:
        body = draw(mutated_bodies())
        if isinstance(body, dict):
            body.pop("max_completion_tokens", None)
            body["max_tokens"] = 1
        raw = json.dumps(body).encode()
    media = draw(st.sampled_from(["application/json"] * 8 + ["text/plain", "application/json; charset=utf-8"]))
    return raw, {"content-type": media}


def test_generated_requests_over_http_never_get_a_5xx(server):
    """500 generated requests through the server, decoding at most one token each: every answer is
    a 200 or a 4xx in OpenAI's error shape, /health stays ok, a valid request still succeeds."""
    url, service = server
    sent, statuses = [0], {}

    with httpx.Client(timeout=120) as client:

        @settings(max_examples=FUZZ_REQUESTS, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(fuzz_requests())
        def check(request):
            raw, headers = request
            r = client.post(f"{url}/v1/chat/completions", content=raw, headers=headers)
            sent[0] += 1
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code < 500, r.text
            if r.status_code >= 400:
                assert r.json()["error"]["type"].endswith("_error")

        check()
        assert client.get(f"{url}/health").json()["status"] == "ok"
    assert sent[0] >= FUZZ_REQUESTS and statuses.get(200, 0) > 0 and len(statuses) > 2, statuses
    r = _post(url, {**BODY, "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    assert service.metrics.requests.get("error", 0) == 0


# -- hypothesis: every admitted schema decodes --------------------------------------------------------
REFS = st.sampled_from(["#", "#/$defs/a", "#/$defs/b"])
SCHEMA_LEAVES = (
    st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "boolean", "null"])})
    | st.fixed_dictionaries({"$ref": REFS})
    | st.just({})
    | st.fixed_dictionaries({"enum": st.lists(st.integers(0, 3), min_size=1, max_size=2)})
)


def _schema_nodes(inner):
    obj = st.builds(
        lambda props, required, extra: {
            "type": "object",
            "properties": props,
            "required": list(props) if required else [],
            **({} if extra is None else {"additionalProperties": extra}),
        },
        st.dictionaries(st.sampled_from(["a", "b", "c"]), inner, max_size=2),
        st.booleans(),
        st.none() | st.booleans() | inner,
    )
    arr = st.builds(lambda items, least: {"type": "array", "items": items, "minItems": least}, inner, st.integers(0, 2))
    return obj | arr | st.builds(lambda bs: {"anyOf": bs}, st.lists(inner, min_size=1, max_size=2))


SCHEMAS = st.builds(
    lambda root, a, b: {**root, "$defs": {"a": a, "b": b}},
    *[st.recursive(SCHEMA_LEAVES, _schema_nodes, max_leaves=6)] * 3,
)
STRUCTURAL = ('{"', "{", '"', "[", "[{", '[{"', ': {"', ', "', '": [', '": {', '": {"')


def test_every_admitted_schema_decodes_without_a_grammar_error(smol):
    """Random recursive schemas (self and $defs references, required or not): either a 400, or a
    grammar that a random walk biased to open structures decodes without error (no model needed)."""
    import random

    from pask.runtime.masked_head import allowed_tokens
    from pask.structure.constraint import allocate_mask

    tok = smol.tokenizer
    vocab = {i: tok.decode([i]) for i in range(len(tok))}

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(SCHEMAS, st.integers(0, 2**32), st.booleans())
    @example(  # found by a clean-clone run: extra properties whose value is a bare $ref cycle
        {"type": "object", "properties": {}, "required": [], "additionalProperties": {"$ref": "#/$defs/a"},
         "$defs": {"a": {"$ref": "#/$defs/a"}, "b": {}}},
        1,
        False,
    )  # fmt: skip
    def check(schema, seed, as_tool):
        body = _tool({"type": "object", "properties": {"x": schema}, "required": ["x"]}) if as_tool else _rf(schema)
        try:
            chat = build_chat_request(body, tok, MODEL)
        except RequestError as e:
            _answerable(e)
            return
        c, rnd = chat.request.constraint, random.Random(seed)
        mask = allocate_mask(1, c.vocab_size)
        for _ in range(30):
            if c.is_done():
                break
            c.mask(mask, 0)
            allowed = allowed_tokens(mask[0], c.vocab_size, limit=c.vocab_size).tolist()
            opening = [t for t in allowed if vocab.get(t, "").strip() in STRUCTURAL]
            c.consume(rnd.choice(opening) if opening and rnd.random() < 0.8 else rnd.choice(allowed))

    check()


def test_json_depth_limit_leaves_room_for_the_deepest_schema(smol):
    """A schema at the depth limit fits inside the body's nesting limit and is accepted."""
    assert 2 * MAX_SCHEMA_DEPTH + 8 < MAX_JSON_DEPTH
    chat = build_chat_request({**_rf(_nested(MAX_SCHEMA_DEPTH - 1)), "max_tokens": 4}, smol.tokenizer, MODEL)
    assert chat.mode == "json" and chat.request.constraint is not None
