"""BFCL task: splits, schema conversion, grammar over the real tokenizer, parsing."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pask.errors import PaskError
from pask.structure.constraint import Constraint, SchemaError, ll_tokenizer
from pask.tasks.function_calling import (
    LIVE,
    NON_LIVE,
    build_grammar,
    check_tools,
    legal_name,
    load_cases,
    parse_calls,
    split_ids,
    to_json_schema,
    to_tools,
)


def test_split_sizes_are_stratified_and_disjoint():
    sizes = {"calibration": 200, "dev": 200, "test": 600}
    seen: set[str] = set()
    for split, n in sizes.items():
        ids = [i for c in NON_LIVE for i in split_ids(c, split)]
        assert len(ids) == n
        assert not seen & set(ids)
        seen |= set(ids)
    assert [len(split_ids(c, "test")) for c in NON_LIVE] == [240, 120, 120, 120]
    assert split_ids("simple", "test") == split_ids("simple", "test")  # deterministic
    for c in LIVE:
        assert split_ids(c, "calibration") == [] and split_ids(c, "dev") == []
        assert len(split_ids(c, "test")) > 0


def test_bad_category_and_split():
    with pytest.raises(PaskError, match="unknown BFCL category"):
        load_cases(["nope"])
    with pytest.raises(PaskError, match="unknown split"):
        load_cases(["simple"], split="train")


def test_schema_conversion():
    doc = {
        "type": "dict",
        "properties": {
            "x": {"type": "float"},
            "t": {"type": "tuple", "items": {"type": "integer"}},
            "a": {"type": "any"},
            "d": {"type": "dict", "properties": {"k": {"type": "string", "enum": ["u", "v"]}}, "required": ["k"]},
        },
        "required": ["x"],
    }
    s = to_json_schema(doc)
    assert s["type"] == "object" and s["additionalProperties"] is False
    assert s["properties"]["x"] == {"type": "number"}
    assert s["properties"]["t"] == {"type": "array", "items": {"type": "integer"}}
    assert s["properties"]["a"] == {}
    assert s["properties"]["d"]["required"] == ["k"]
    assert s["properties"]["d"]["properties"]["k"]["enum"] == ["u", "v"]
    with pytest.raises(PaskError):
        to_json_schema({"type": "complex128"})


def test_dotted_names_map_back():
    tools, name_map = to_tools([{"name": "math.factorial", "parameters": {"type": "dict", "properties": {}}}])
    assert tools[0]["function"]["name"] == "math_factorial"
    text = '<tool_call>\n{"name": "math_factorial", "arguments": {"n": 5}}\n</tool_call>\n'
    assert parse_calls(text, name_map) == [{"math.factorial": {"n": 5}}]


@given(st.text(min_size=1, max_size=30))
def test_legal_name_is_legal(name):
    out = legal_name(name)
    assert all(ch.isascii() and (ch.isalnum() or ch in "_-") for ch in out)


def _call_text(case) -> str:
    """Ground-truth calls in the model's native format (first allowed value of each param)."""
    blocks = []
    legal = {v: k for k, v in case.name_map.items()}
    for entry in case.possible_answer:
        ((name, params),) = entry.items()
        args = {k: v[0] for k, v in params.items() if v and v[0] != ""}
        body = json.dumps({"name": legal[name], "arguments": args})
        blocks.append(f"<tool_call>\n{body}\n</tool_call>")
    return "\n".join(blocks) + "\n"


def test_grammar_accepts_ground_truth_calls(qwen_tokenizer):
    """Over a sample of every non-live category: gold calls tokenise into an accepted grammar path."""
    tok = qwen_tokenizer
    eos = [tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id]
    llt = ll_tokenizer(tok, eos)
    accepted = total = 0
    for case in load_cases(list(NON_LIVE), split="test", limit=25):
        c = Constraint(llt, build_grammar(case.tools, tok))
        ids = tok(_call_text(case), add_special_tokens=False)["input_ids"]
        total += 1
        try:
            for t in ids:
                c.consume(t)
            accepted += c.is_accepting()
        except SchemaError:
            pass
    # gold values may violate their own schema (e.g. a string for an integer param); allow a few
    assert accepted / total >= 0.9, (accepted, total)


def test_grammar_rejects_unknown_function_and_extra_key(qwen_tokenizer):
    tok = qwen_tokenizer
    llt = ll_tokenizer(tok, [tok.eos_token_id])
    tools, _ = to_tools(
        [{"name": "f", "parameters": {"type": "dict", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}]
    )
    g = build_grammar(tools, tok)
    for bad in ('<tool_call>\n{"name": "g"', '<tool_call>\n{"name": "f", "arguments": {"b"'):
        c = Constraint(llt, g)
        with pytest.raises(SchemaError):
            for t in tok(bad, add_special_tokens=False)["input_ids"]:
                c.consume(t)


def test_unsatisfiable_schema_is_a_schema_error(qwen_tokenizer):
    tok = qwen_tokenizer
    llt = ll_tokenizer(tok, [tok.eos_token_id])
    tools = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {"type": "object", "properties": {}, "required": ["x"], "additionalProperties": False},
            },
        }
    ]
    with pytest.raises(SchemaError, match="nsatisfiable"):
        Constraint(llt, build_grammar(tools, tok))
    with pytest.raises(PaskError):
        build_grammar([], tok)


def test_parse_calls_rejects_bad_json():
    with pytest.raises(PaskError):
        parse_calls("<tool_call>\n{not json}\n</tool_call>")
    assert parse_calls("no calls here") == []


def test_grammar_accepts_later_call_without_marker(qwen_tokenizer):
    tok = qwen_tokenizer
    llt = ll_tokenizer(tok, [tok.convert_tokens_to_ids("<|im_end|>")])
    tools, name_map = to_tools(
        [{"name": "f", "parameters": {"type": "dict", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}]
    )
    text = (
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
        '{"name": "f", "arguments": {"a": 2}}\n</tool_call>\n'
    )
    c = Constraint(llt, build_grammar(tools, tok))
    for t in tok(text, add_special_tokens=False)["input_ids"]:
        c.consume(t)
    assert c.is_accepting()
    assert parse_calls(text, name_map) == [{"f": {"a": 1}}, {"f": {"a": 2}}]
    c = Constraint(llt, build_grammar(tools, tok))  # the first call still needs its marker
    with pytest.raises(SchemaError):
        for t in tok('{"name"', add_special_tokens=False)["input_ids"]:
            c.consume(t)


def _tool(params, name="get_weather") -> dict:
    return {"type": "function", "function": {"name": name, "parameters": params}}


def test_check_tools_names_tool_property_and_cause():
    days = {"type": "object", "properties": {"days": {"type": "number", "minimum": 10, "maximum": 1}}}
    fine = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    with pytest.raises(PaskError, match=r"^tool 'get_weather', property 'days': minimum 10 > maximum 1"):
        check_tools([_tool(fine, "ok"), _tool(days)])
    with pytest.raises(PaskError, match=r"^tool 'get_weather', property 'unit': enum is empty"):
        check_tools([_tool({"type": "object", "properties": {"unit": {"enum": []}}})])
    nested = {"type": "object", "properties": {"spans": {"type": "array", "items": {"minLength": 5, "maxLength": 2}}}}
    with pytest.raises(PaskError, match=r"property 'spans\[\]': minLength 5 > maxLength 2"):
        check_tools([_tool(nested)])
    ref = {
        "type": "object",
        "properties": {"unit": {"$ref": "#/$defs/Unit"}},
        "required": ["unit"],
        "$defs": {"Unit": {"type": "integer", "enum": ["C", "F"]}},
    }
    with pytest.raises(PaskError, match=r"^tool 'get_weather', property 'unit': unsatisfiable: no enum value"):
        check_tools([_tool(ref)])
    check_tools([_tool(fine), _tool(None, "no_args"), {"function": {"name": "bare"}}])
    check_tools([])


@pytest.mark.parametrize(
    ("tools", "expected"),
    [
        ([{"type": "function", "function": {"parameters": {"type": "object"}}}], r"^tools\[0\] has no name"),
        ([{"type": "function", "function": {"name": ""}}], r"^tools\[0\] has no name"),
        ([{"type": "retrieval"}], r"^tools\[0\] must be \{'type': 'function'"),
        (["get_weather"], r"^tools\[0\] must be"),
        ([_tool({"type": "string"})], r"^tool 'get_weather': parameters must be an object schema"),
        ([_tool(["city"])], r"^tool 'get_weather': parameters must be a JSON Schema object, got list"),
        ([_tool({}), _tool({})], r"^tool 'get_weather' is defined twice"),
        ([_tool({}, "math.factorial")], r"^tool 'math.factorial': a name is .* \(e.g. 'math_factorial'\)"),
        ([_tool({"type": "object", "properties": {"n": {"type": "int"}}})], r"unknown type 'int'; did you mean"),
        (
            [_tool({"type": "object", "properties": {}, "required": ["x"], "additionalProperties": False})],
            r"^tool 'get_weather', property 'x': unsatisfiable",
        ),
        ("get_weather", r"^tools must be a list"),
    ],
)
def test_check_tools_rejects(tools, expected):
    with pytest.raises(PaskError, match=expected):
        check_tools(tools)


def test_check_tools_passes_bfcl():
    """Every BFCL case's tools pass check_tools, and no parameter is one no value fits (an optional one
    would be left out of the grammar silently)."""
    from pask.structure.schema_check import check_json_schema
    from pask.tasks.bfcl_checker import CATEGORIES
    from pask.tasks.function_calling import _load_category

    rejected = {}
    for category in CATEGORIES:
        for case in _load_category(category):
            try:
                check_tools(case.tools)
                for tool in case.tools:
                    for name, sub in tool["function"]["parameters"]["properties"].items():
                        check_json_schema(sub, f"tool '{tool['function']['name']}', property '{name}'")
            except PaskError as e:
                rejected[case.id] = str(e)
    assert not rejected, rejected


def test_enum_on_array_goes_to_items():
    s = to_json_schema({"type": "array", "enum": ["a", "b"], "description": "d"})
    assert s == {"type": "array", "description": "d", "items": {"type": "string", "enum": ["a", "b"]}}
    s = to_json_schema({"type": "list", "enum": [1, 2.5]})
    assert s["items"] == {"type": "number", "enum": [1, 2.5]}
    s = to_json_schema({"type": "tuple", "enum": ["a", 1]})  # mixed values: no type for the items
    assert s == {"type": "array", "items": {"enum": ["a", 1]}}


def test_enum_on_array_with_items_keeps_them():
    doc = {"type": "array", "items": {"type": "string", "description": "a metric"}, "enum": ["buzz", "trust"]}
    s = to_json_schema(doc)
    assert "enum" not in s
    assert s["items"] == {"type": "string", "description": "a metric", "enum": ["buzz", "trust"]}
    own = {"type": "array", "items": {"type": "string", "enum": ["x"]}, "enum": ["buzz"]}
    assert to_json_schema(own) == {"type": "array", "items": {"type": "string", "enum": ["x"]}}
    wrong = {"type": "array", "items": {"type": "integer"}, "enum": ["buzz"]}  # no value fits the items
    assert to_json_schema(wrong) == {"type": "array", "items": {"type": "integer"}}
    whole = {"type": "array", "items": {"type": "integer"}, "enum": [[1, 2], [3], "x"]}  # whole-array values
    assert to_json_schema(whole) == {"type": "array", "items": {"type": "integer"}, "enum": [[1, 2], [3]]}


def test_enum_keeps_only_values_of_the_type():
    # BFCL's integer parameter with string values (live_multiple_560-155-0): no int remains, the enum goes
    assert to_json_schema({"type": "integer", "enum": ["1", "2", "dontcare"]}) == {"type": "integer"}
    assert to_json_schema({"type": "integer", "enum": [1, "2", True, 3.5]}) == {"type": "integer", "enum": [1]}
    assert to_json_schema({"type": "float", "enum": [1, 2.5, "3", False]}) == {"type": "number", "enum": [1, 2.5]}
    assert to_json_schema({"type": "string", "enum": ["a", 1, None]}) == {"type": "string", "enum": ["a"]}
    assert to_json_schema({"type": "boolean", "enum": ["True", "False", "dontcare"]}) == {"type": "boolean"}
    assert to_json_schema({"type": "boolean", "enum": [True]}) == {"type": "boolean", "enum": [True]}
    assert to_json_schema({"type": "string", "enum": []}) == {"type": "string"}
    assert to_json_schema({"type": "any", "enum": ["a", 1]}) == {"enum": ["a", 1]}
    for doc in (
        {"type": "integer", "enum": ["1"]},
        {"type": "array", "enum": ["a"]},
        {"type": "boolean", "enum": ["x"]},
    ):
        check_tools([_tool(to_json_schema({"type": "dict", "properties": {"p": doc}, "required": ["p"]}))])


def test_bfcl_array_enum_case_is_satisfiable(smol_tokenizer):
    """live_simple_71-35-0 offers an array whose enum names the elements: its grammar compiles, a call
    with listed elements fits the schema and the grammar, and one with another element fits neither."""
    import jsonschema

    from pask.runtime.tokens import eos_ids
    from pask.tasks.function_calling import find_case

    case = find_case("live_simple_71-35-0")
    (tool,) = case.tools
    params = tool["function"]["parameters"]
    assert params["properties"]["metrics"]["items"]["enum"][:2] == ["favorability", "admired employer"]
    check_tools(case.tools)
    args = {"demographics": ["millennials"], "targets": ["brand:Apple"], "metrics": ["view"], "min_date": "2022-07-01"}
    jsonschema.validate(args, params)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**args, "metrics": ["popularity"]}, params)

    tok = smol_tokenizer
    llt = ll_tokenizer(tok, eos_ids(tok))
    grammar = build_grammar(case.tools, tok)
    c = Constraint(llt, grammar)
    for t in tok(_call_text(case), add_special_tokens=False)["input_ids"]:
        c.consume(t)
    assert c.is_accepting()
    bad = json.dumps({"name": tool["function"]["name"], "arguments": {**args, "metrics": ["popularity"]}})
    c = Constraint(llt, grammar)
    with pytest.raises(SchemaError):
        for t in tok(f"<tool_call>\n{bad}\n</tool_call>\n", add_special_tokens=False)["input_ids"]:
            c.consume(t)
