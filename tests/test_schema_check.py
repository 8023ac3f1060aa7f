"""Schema check before any model loads: malformed and unsatisfiable schemas, named by property."""

from __future__ import annotations

import llguidance
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pask.errors import PaskError
from pask.structure.schema_check import _SEPARATORS, check_json_schema, check_response_format


def obj(props: dict, required: list[str] | None = None, **extra) -> dict:
    """An object schema; every property required unless ``required`` says otherwise."""
    return {"type": "object", "properties": props, "required": list(props) if required is None else required, **extra}


def rejected(schema, where: str = "schema") -> str:
    with pytest.raises(PaskError) as e:
        check_json_schema(schema, where)
    return str(e.value)


@pytest.mark.parametrize(
    ("schema", "expected"),
    [
        (obj({"days": {"type": "number", "minimum": 10, "maximum": 1}}), "property 'days': minimum 10 > maximum 1"),
        (obj({"days": {"type": "number", "minimum": 10, "maximum": 1}}, []), "property 'days': minimum 10 > maximum 1"),
        (obj({"x": {"type": "number", "exclusiveMinimum": 3, "maximum": 3}}), "exclusiveMinimum 3 = maximum 3"),
        (obj({"unit": {"enum": []}}), "property 'unit': enum is empty"),
        (obj({"s": {"type": "string", "minLength": 5, "maxLength": 2}}), "property 's': minLength 5 > maxLength 2"),
        (obj({"a": {"type": "array", "minItems": 3, "maxItems": 1}}), "property 'a': minItems 3 > maxItems 1"),
        (obj({"o": {"type": "object", "minProperties": 2, "maxProperties": 0}}), "minProperties 2 > maxProperties 0"),
        (
            obj({"a": {"type": "array", "items": obj({"n": {"type": "integer", "minimum": 5, "maximum": 2}})}}),
            "property 'a[].n': minimum 5 > maximum 2",
        ),
        (
            obj({"loc": obj({"city": {"type": "string", "enum": [1, 2]}})}),
            "property 'loc.city': unsatisfiable: no enum value is of type 'string'",
        ),
        (obj({"c": {"type": "integer", "const": "a"}}), "property 'c': unsatisfiable: const \"a\" is not of type"),
        (obj({"d": {"type": "integer", "minimum": 1.2, "maximum": 1.8}}), "unsatisfiable: no integer satisfies"),
        (
            obj({"d": {"$ref": "#/$defs/Span"}}, **{"$defs": {"Span": {"minLength": 5, "maxLength": 2}}}),
            "in '$defs/Span': minLength 5 > maxLength 2",
        ),
        (
            obj({"d": {"$ref": "#/$defs/Unit"}}, **{"$defs": {"Unit": {"type": "integer", "enum": ["C", "F"]}}}),
            "property 'd': unsatisfiable: no enum value is of type 'integer' (enum [\"C\", \"F\"]) (via $ref",
        ),
        (obj({"d": {"$ref": "#/$defs/nope"}}), "property 'd': $ref '#/$defs/nope' points to nothing"),
        (obj({"d": {"type": "dict"}}), "property 'd': unknown type 'dict'; did you mean 'object'?"),
        (obj({"d": {"type": "foo"}}), "property 'd': unknown type 'foo' (types: array, boolean"),
        (obj({"d": {"type": ["string", "float"]}}), "unknown type 'float'; did you mean 'number'?"),
        (
            {"type": "object", "properties": {}, "required": ["x"], "additionalProperties": False},
            "property 'x': unsatisfiable: required, but not among 'properties' and additionalProperties is false",
        ),
        (
            obj({"d": {"anyOf": [{"type": "integer", "const": "a"}, {"type": "string", "enum": [3]}]}}),
            "property 'd': unsatisfiable: every anyOf branch is unsatisfiable",
        ),
        (obj({"a": {"type": "array", "items": False, "minItems": 1}}), "property 'a[]': unsatisfiable"),
        (obj({"a": {}, "b": {}}, maxProperties=1), "unsatisfiable: 2 required properties > maxProperties 1"),
        (obj({"d": {"type": "number", "minimum": "x"}}), "property 'd': not a valid JSON Schema: minimum: 'x'"),
        (obj({"d": {"type": "array", "items": {"maxLength": -1}}}), "property 'd[]': not a valid JSON Schema"),
        (obj({"d": {"type": "string", "pattern": "(("}}), "property 'd': not a valid JSON Schema: pattern"),
        (obj({"d": "string"}), "property 'd': a schema must be an object or a boolean, got a string"),
        (  # items that recurse without end: the array could only be empty, yet an item could be started
            {
                "type": "array",
                "items": {"$ref": "#/$defs/a"},
                "$defs": {"a": obj({"a": {"$ref": "#/$defs/a"}})},
            },
            "an item could be started and never finished",
        ),
        (  # additional properties whose value is a bare $ref cycle: a key could be started, its value never
            {
                "type": "object",
                "properties": {},
                "additionalProperties": {"$ref": "#/$defs/a"},
                "$defs": {"a": {"$ref": "#/$defs/a"}, "b": {}},
            },
            "a property could be started and never finished",
        ),
        (
            {
                "type": "object",
                "patternProperties": {"^x": {"$ref": "#/$defs/a"}},
                "$defs": {"a": obj({"a": {"$ref": "#/$defs/a"}})},
            },
            "a property could be started and never finished",
        ),
        ([1], "a JSON Schema must be an object, got a list"),
        (False, "unsatisfiable: the schema is false"),
    ],
)
def test_rejected_with_property_and_cause(schema, expected):
    msg = rejected(schema, "tool 'get_weather'")
    assert msg.startswith("tool 'get_weather'")
    assert expected in msg


@pytest.mark.parametrize(
    "schema",
    [
        True,
        {},
        obj({"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 14}}, ["city"]),
        obj({"unit": {"type": "string", "enum": ["C", "F"]}, "n": {"type": ["integer", "null"]}}),
        obj({"d": {"anyOf": [{"type": "integer", "const": "a"}, {"type": "string"}]}}),  # one branch suffices
        obj({"bad": {"type": "integer", "enum": ["1", "dontcare"]}}, []),  # optional: just never sent (BFCL has such)
        obj({"a": {"type": "array", "items": {"type": "integer", "enum": ["x"]}}}),  # the empty array fits
        {**obj({"d": {"$ref": "#/$defs/Unit"}}), "$defs": {"Unit": {"type": "string", "enum": ["C", "F"]}}},
        {  # a recursive $ref
            "$ref": "#/$defs/Node",
            "$defs": {"Node": obj({"kids": {"type": "array", "items": {"$ref": "#/$defs/Node"}}})},
        },
        obj({"x": {"type": "number", "minimum": 1, "maximum": 1}}),
        obj({"x": {"type": "integer", "exclusiveMinimum": 1, "exclusiveMaximum": 3}}),
    ],
)
def test_fine_schemas_pass(schema):
    check_json_schema(schema)


def test_response_format_is_named():
    with pytest.raises(PaskError, match=r"^response_format, property 'a': minimum 3 > maximum 1"):
        check_response_format(obj({"a": {"type": "integer", "minimum": 3, "maximum": 1}}))
    with pytest.raises(PaskError, match=r"^response_format: minItems 3 > maxItems 1"):
        check_response_format({"type": "array", "minItems": 3, "maxItems": 1})
    check_response_format(obj({"a": {"type": "string"}}))


def test_llguidance_is_the_last_word():
    """What the own passes miss, llguidance's compile (without a tokenizer) still catches, with the property."""
    schema = obj({"s": {"type": "string", "minLength": 3, "enum": ["ab"]}})  # the enum value is too short
    msg = rejected(schema, "tool 'f'")
    assert "tool 'f'" in msg and "llguidance" in msg


_BOUND_PAIRS = [
    ("minimum", "maximum", "number"),
    ("minLength", "maxLength", "string"),
    ("minItems", "maxItems", "array"),
    ("minProperties", "maxProperties", "object"),
]


@given(
    pair=st.sampled_from(_BOUND_PAIRS),
    hi=st.integers(0, 1000),
    gap=st.integers(1, 1000),
    name=st.from_regex(r"[a-z_]{1,12}", fullmatch=True),
    required=st.booleans(),
    nest=st.sampled_from(["", "items", "object"]),
)
@settings(max_examples=60, deadline=None)
def test_any_min_above_max_is_rejected(pair, hi, gap, name, required, nest):
    low, high, typ = pair
    prop = {"type": typ, low: hi + gap, high: hi}
    path = name
    if nest == "items":
        prop, path = {"type": "array", "items": prop}, f"{name}[]"
    elif nest == "object":
        prop, path = obj({"inner": prop}), f"{name}.inner"
    msg = rejected(obj({name: prop}, [name] if required else []), "tool 't'")
    assert msg == f"tool 't', property '{path}': {low} {hi + gap} > {high} {hi}" + (
        ": no number lies between them" if low == "minimum" else ""
    )


def _leaf() -> st.SearchStrategy[dict]:
    def bounded(typ: str, low: str, high: str, top: int = 50):
        return st.tuples(st.integers(0, top), st.integers(0, top)).map(
            lambda ab: {"type": typ, low: min(ab), high: max(ab)}
        )

    return st.one_of(
        st.just({"type": "string"}),
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
        bounded("string", "minLength", "maxLength", 8),
        bounded("integer", "minimum", "maximum"),
        bounded("number", "minimum", "maximum"),
        st.lists(st.text(max_size=5), min_size=1, max_size=4, unique=True).map(
            lambda vs: {"type": "string", "enum": vs}
        ),
        st.lists(st.integers(-5, 5), min_size=1, max_size=4, unique=True).map(
            lambda vs: {"type": "integer", "enum": vs}
        ),
    )


_NAMES = st.from_regex(r"[a-z][a-z0-9_]{0,7}", fullmatch=True)


def _grow(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    objects = st.dictionaries(_NAMES, children, max_size=4).flatmap(
        lambda props: (
            st.lists(st.sampled_from(sorted(props)), unique=True).map(
                lambda req: {"type": "object", "properties": props, "required": req, "additionalProperties": False}
            )
            if props
            else st.just({"type": "object", "properties": {}})
        )
    )
    arrays = st.tuples(children, st.integers(0, 2), st.integers(0, 2)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": min(t[1:]), "maxItems": max(t[1:])}
    )
    unions = st.lists(children, min_size=1, max_size=3).map(lambda bs: {"anyOf": bs})
    return st.one_of(objects, arrays, unions)


_SATISFIABLE = st.recursive(_leaf(), _grow, max_leaves=8)


@given(props=st.dictionaries(_NAMES, _SATISFIABLE, max_size=4), data=st.data())
@settings(max_examples=80, deadline=None)
def test_satisfiable_schemas_pass(props, data):
    required = data.draw(st.lists(st.sampled_from(sorted(props)), unique=True)) if props else []
    schema = obj(props, required)
    check_json_schema(schema)  # raises on any false alarm
    grammar = llguidance.LLMatcher.grammar_from_json_schema({**schema, "x-guidance": _SEPARATORS})
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""  # and llguidance agrees
