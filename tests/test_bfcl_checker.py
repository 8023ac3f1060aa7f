"""Tests of pask's BFCL AST checker: one test per rule, properties, and a cross-check against bfcl-eval's checker."""

from __future__ import annotations

import copy
import dataclasses
import importlib
import importlib.util
import json
import sys
import time
import types
from collections import Counter
from collections.abc import Callable, Iterator
from functools import lru_cache
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pask.errors import PaskError
from pask.tasks.bfcl_checker import (
    CATEGORIES,
    CheckResult,
    bfcl_data_dir,
    check_calls,
    load_possible_answers,
    normalize_string,
)

HAS_BFCL = importlib.util.find_spec("bfcl_eval") is not None
requires_bfcl = pytest.mark.skipif(not HAS_BFCL, reason="bfcl-eval is not installed")

PARALLEL = ("parallel", "parallel_multiple", "live_parallel", "live_parallel_multiple")
# bfcl-eval matches parallel calls greedily in ground-truth order; ours finds a maximum matching. In these
# cases a ground-truth entry's allowed values overlap another's, so some correct call orders fail bfcl-eval.
KNOWN_GREEDY_CASES = frozenset({"parallel_178", "parallel_180"})
BFCL_MODEL = "pask-checker-test"  # model name handed to bfcl-eval; its stub config keeps dotted names


def fn(name: str, props: dict[str, dict], required: tuple[str, ...] = ()) -> dict:
    """A BFCL function doc."""
    return {
        "name": name,
        "description": "",
        "parameters": {"type": "dict", "properties": props, "required": list(required)},
    }


def verdict(functions: list[dict], calls: list[dict], answer: list[dict], category: str = "simple") -> bool:
    return check_calls(functions, calls, answer, category).correct


# ---------------------------------------------------------------- hand-written rules

AREA = fn(
    "geometry.area",
    {"base": {"type": "integer"}, "height": {"type": "float"}, "unit": {"type": "string"}},
    required=("base", "height"),
)
AREA_GT = [{"geometry.area": {"base": [10], "height": [5.0, 5.5], "unit": ["units", ""]}}]


def test_categories_in_order() -> None:
    assert CATEGORIES == (
        "simple",
        "multiple",
        "parallel",
        "parallel_multiple",
        "live_simple",
        "live_multiple",
        "live_parallel",
        "live_parallel_multiple",
    )


def test_exact_call_is_correct_and_result_is_frozen() -> None:
    res = check_calls([AREA], [{"geometry.area": {"base": 10, "height": 5.0, "unit": "units"}}], AREA_GT, "simple")
    assert res == CheckResult(True, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        res.correct = False  # type: ignore[misc]


def test_wrong_function_name() -> None:
    res = check_calls([AREA], [{"geometry_area": {"base": 10, "height": 5.0}}], AREA_GT, "simple")
    assert not res.correct
    assert "geometry.area" in res.error and "geometry_area" in res.error


def test_missing_required_parameter() -> None:
    res = check_calls([AREA], [{"geometry.area": {"height": 5.0}}], AREA_GT, "simple")
    assert not res.correct
    assert res.error == "missing required parameter 'base' in geometry.area"


def test_unknown_parameter() -> None:
    res = check_calls([AREA], [{"geometry.area": {"base": 10, "height": 5.0, "colour": "red"}}], AREA_GT, "simple")
    assert not res.correct
    assert "unknown parameter 'colour'" in res.error


def test_parameter_not_in_ground_truth() -> None:
    doc = fn("f", {"a": {"type": "integer"}, "b": {"type": "integer"}}, required=("a",))
    assert verdict([doc], [{"f": {"a": 1}}], [{"f": {"a": [1]}}])
    res = check_calls([doc], [{"f": {"a": 1, "b": 2}}], [{"f": {"a": [1]}}], "simple")
    assert not res.correct and "unexpected parameter 'b'" in res.error


def test_int_accepted_for_float_but_not_float_for_int() -> None:
    assert verdict([AREA], [{"geometry.area": {"base": 10, "height": 5}}], AREA_GT)
    res = check_calls([AREA], [{"geometry.area": {"base": 10.0, "height": 5.0}}], AREA_GT, "simple")
    assert not res.correct and "wrong type for 'base'" in res.error


def test_bool_is_not_an_integer_and_int_is_not_a_bool() -> None:
    doc = fn("f", {"n": {"type": "integer"}, "flag": {"type": "boolean"}}, required=("n", "flag"))
    gt = [{"f": {"n": [1], "flag": [True]}}]
    assert verdict([doc], [{"f": {"n": 1, "flag": True}}], gt)
    assert not verdict([doc], [{"f": {"n": True, "flag": True}}], gt)
    assert not verdict([doc], [{"f": {"n": 1, "flag": 1}}], gt)


def test_wrong_type_and_wrong_value() -> None:
    res = check_calls([AREA], [{"geometry.area": {"base": "10", "height": 5.0}}], AREA_GT, "simple")
    assert not res.correct and res.error.startswith("wrong type for 'base'")
    res = check_calls([AREA], [{"geometry.area": {"base": 11, "height": 5.0}}], AREA_GT, "simple")
    assert not res.correct and res.error == "invalid value for 'base' in geometry.area: 11"


def test_empty_marker_allows_omission() -> None:
    assert verdict([AREA], [{"geometry.area": {"base": 10, "height": 5.5}}], AREA_GT)
    # "" normalises to "", so an empty string stands for "left out" too (as in BFCL).
    assert verdict([AREA], [{"geometry.area": {"base": 10, "height": 5.5, "unit": ""}}], AREA_GT)
    gt_required_unit = [{"geometry.area": {"base": [10], "height": [5.0], "unit": ["units"]}}]
    res = check_calls([AREA], [{"geometry.area": {"base": 10, "height": 5.0}}], gt_required_unit, "simple")
    assert not res.correct and res.error == "missing parameter 'unit' in geometry.area"


@pytest.mark.parametrize(
    ("given", "allowed"),
    [
        ("New York, NY", "new york ny"),
        ("2022-01-01", "20220101"),
        ("A/B_C*D^E.F", "abcdef"),
        ("it's", 'IT"S'),
        ("  Spaced   Out ", "spacedout"),
    ],
)
def test_string_normalisation(given: str, allowed: str) -> None:
    doc = fn("f", {"s": {"type": "string"}}, required=("s",))
    assert verdict([doc], [{"f": {"s": given}}], [{"f": {"s": [allowed]}}])


def test_string_normalisation_keeps_other_characters() -> None:
    doc = fn("f", {"s": {"type": "string"}}, required=("s",))
    assert not verdict([doc], [{"f": {"s": "new york!"}}], [{"f": {"s": ["new york"]}}])
    assert normalize_string("Jan. 1, 2022") == "jan12022"


def test_list_of_strings_is_normalised_element_wise_and_ordered() -> None:
    doc = fn("f", {"xs": {"type": "array", "items": {"type": "string"}}}, required=("xs",))
    gt = [{"f": {"xs": [["New York", "Los Angeles"], ["NYC", "LA"]]}}]
    assert verdict([doc], [{"f": {"xs": ["new york", "LOS-ANGELES"]}}], gt)
    assert verdict([doc], [{"f": {"xs": ["nyc", "la"]}}], gt)
    assert not verdict([doc], [{"f": {"xs": ["Los Angeles", "New York"]}}], gt)
    assert not verdict([doc], [{"f": {"xs": ["New York"]}}], gt)
    assert not verdict([doc], [{"f": {"xs": ["New York", 3]}}], gt)  # element of the wrong type


def test_nested_list_is_compared_exactly() -> None:
    doc = fn("f", {"m": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}}}, ("m",))
    gt = [{"f": {"m": [[[1, 2], [3, 4]]]}}]
    assert verdict([doc], [{"f": {"m": [[1, 2], [3, 4]]}}], gt)
    assert not verdict([doc], [{"f": {"m": [[1, 2], [4, 3]]}}], gt)


def test_list_elements_are_not_converted_from_int_to_float() -> None:
    # BFCL converts int → float only for a top-level float parameter, not inside arrays.
    doc = fn("f", {"xs": {"type": "array", "items": {"type": "float"}}}, required=("xs",))
    assert verdict([doc], [{"f": {"xs": [1.0, 2.5]}}], [{"f": {"xs": [[1.0, 2.5]]}}])
    assert not verdict([doc], [{"f": {"xs": [1, 2.5]}}], [{"f": {"xs": [[1.0, 2.5]]}}])


def test_tuple_parameter_accepts_list_or_tuple() -> None:
    doc = fn("f", {"p": {"type": "tuple", "items": {"type": "integer"}}}, required=("p",))
    gt = [{"f": {"p": [[1, 2]]}}]
    assert verdict([doc], [{"f": {"p": (1, 2)}}], gt)
    assert verdict([doc], [{"f": {"p": [1, 2]}}], gt)
    assert not verdict([doc], [{"f": {"p": (2, 1)}}], gt)


def test_empty_list_stands_for_omission_when_allowed() -> None:
    doc = fn("f", {"xs": {"type": "array", "items": {"type": "string"}}})
    assert verdict([doc], [{"f": {"xs": []}}], [{"f": {"xs": ["", ["a"]]}}])
    assert not verdict([doc], [{"f": {"xs": []}}], [{"f": {"xs": [["a"]]}}])


DICT_DOC = fn("db.query", {"where": {"type": "dict", "properties": {}}}, required=("where",))
DICT_GT = [{"db.query": {"where": [{"school": ["Bluebird High School", "Bluebird HS"], "grade": [10, ""]}]}}]


def test_dict_values_are_normalised_per_key() -> None:
    assert verdict([DICT_DOC], [{"db.query": {"where": {"school": "bluebird hs", "grade": 10}}}], DICT_GT)
    assert verdict([DICT_DOC], [{"db.query": {"where": {"school": "Bluebird High-School"}}}], DICT_GT)
    assert not verdict([DICT_DOC], [{"db.query": {"where": {"school": "Bluebird", "grade": 10}}}], DICT_GT)
    assert not verdict([DICT_DOC], [{"db.query": {"where": {"school": "bluebird hs", "grade": 11}}}], DICT_GT)


def test_dict_keys_must_match() -> None:
    assert not verdict([DICT_DOC], [{"db.query": {"where": {"grade": 10}}}], DICT_GT)  # required key missing
    extra = {"school": "Bluebird HS", "city": "X"}
    assert not verdict([DICT_DOC], [{"db.query": {"where": extra}}], DICT_GT)
    assert not verdict([DICT_DOC], [{"db.query": {"where": "school=Bluebird HS"}}], DICT_GT)


def test_list_of_dicts_is_checked_dict_by_dict_in_order() -> None:
    doc = fn("f", {"rows": {"type": "array", "items": {"type": "dict"}}}, required=("rows",))
    gt = [{"f": {"rows": [[{"name": ["Chester"], "age": [42]}, {"name": ["Jane"], "age": [43, ""]}]]}}]
    assert verdict([doc], [{"f": {"rows": [{"name": "chester", "age": 42}, {"name": "Jane"}]}}], gt)
    assert not verdict([doc], [{"f": {"rows": [{"name": "Jane", "age": 43}, {"name": "Chester", "age": 42}]}}], gt)
    assert not verdict([doc], [{"f": {"rows": [{"name": "Chester", "age": 42}]}}], gt)


def test_nested_dict_values_are_compared_exactly() -> None:
    doc = fn("f", {"ego": {"type": "dict"}}, required=("ego",))
    gt = [{"f": {"ego": [{"position": [{"lateral": 10.5, "longitudinal": 50}], "orientation": [30]}]}}]
    good = {"position": {"lateral": 10.5, "longitudinal": 50}, "orientation": 30}
    assert verdict([doc], [{"f": {"ego": good}}], gt)
    bad = {"position": {"lateral": 10.5, "longitudinal": 51}, "orientation": 30}
    assert not verdict([doc], [{"f": {"ego": bad}}], gt)


def test_values_of_another_type_than_declared_are_literals() -> None:
    # BFCL writes variable names as strings even for non-string parameters; they compare exactly.
    doc = fn("plot", {"x": {"type": "array", "items": {"type": "float"}}}, required=("x",))
    gt = [{"plot": {"x": ["data['sales']"]}}]
    assert verdict([doc], [{"plot": {"x": "data['sales']"}}], gt)
    assert not verdict([doc], [{"plot": {"x": "DATA['sales']"}}], gt)
    assert not verdict([doc], [{"plot": {"x": [1.0]}}], gt)
    nullable = fn("g", {"s": {"type": "string"}})
    assert verdict([nullable], [{"g": {"s": None}}], [{"g": {"s": ["", None]}}])


def test_multiple_picks_one_function_among_several() -> None:
    other = fn("volume", {"side": {"type": "integer"}}, required=("side",))
    assert verdict([other, AREA], [{"geometry.area": {"base": 10, "height": 5.0}}], AREA_GT, "multiple")
    res = check_calls([other, AREA], [{"volume": {"side": 10}}], AREA_GT, "live_multiple")
    assert not res.correct and "expected function 'geometry.area'" in res.error


@pytest.mark.parametrize("category", ["simple", "multiple", "live_simple", "live_multiple"])
def test_single_call_categories_need_exactly_one_call(category: str) -> None:
    call = {"geometry.area": {"base": 10, "height": 5.0}}
    for calls in ([], [call, call]):
        res = check_calls([AREA], calls, AREA_GT, category)
        assert not res.correct
        assert res.error == f"expected 1 call, got {len(calls)}"


WEATHER = fn("weather.get", {"city": {"type": "string"}, "unit": {"type": "string"}}, required=("city",))
WEATHER_GT = [
    {"weather.get": {"city": ["Boston", "Boston, MA"], "unit": ["", "celsius"]}},
    {"weather.get": {"city": ["Paris"], "unit": ["", "celsius"]}},
    {"weather.get": {"city": ["Tokyo"], "unit": ["", "celsius"]}},
]


@pytest.mark.parametrize("category", PARALLEL)
def test_parallel_is_order_free(category: str) -> None:
    calls = [{"weather.get": {"city": c}} for c in ("Tokyo", "boston", "Paris")]
    assert verdict([WEATHER], calls, WEATHER_GT, category)
    assert verdict([WEATHER], calls[::-1], WEATHER_GT, category)


def test_parallel_needs_one_call_per_ground_truth_entry() -> None:
    three = [{"weather.get": {"city": c}} for c in ("Boston", "Paris", "Tokyo")]
    res = check_calls([WEATHER], three[:2], WEATHER_GT, "parallel")
    assert not res.correct and res.error == "expected 3 calls, got 2"
    res = check_calls([WEATHER], [*three, three[0]], WEATHER_GT, "parallel")
    assert not res.correct and res.error == "expected 3 calls, got 4"
    duplicated = [three[0], three[0], three[2]]  # Paris is never called
    res = check_calls([WEATHER], duplicated, WEATHER_GT, "parallel")
    assert not res.correct
    assert res.error == (
        "no call matches ground-truth call 1 (weather.get); call 1: invalid value for 'city' in weather.get: 'Boston'"
    )


def test_parallel_uses_a_maximum_matching() -> None:
    # Entry 0 allows Microsoft or Apple, entry 1 only Apple: a greedy first fit in ground-truth order pairs
    # entry 0 with the Apple call and leaves entry 1 without one; a one-to-one matching exists.
    doc = fn("price", {"company": {"type": "string"}}, required=("company",))
    gt = [{"price": {"company": ["Microsoft", "Apple"]}}, {"price": {"company": ["Apple"]}}]
    assert verdict([doc], [{"price": {"company": "Apple"}}, {"price": {"company": "Microsoft"}}], gt, "parallel")
    assert not verdict([doc], [{"price": {"company": "Apple"}}, {"price": {"company": "Apple!"}}], gt, "parallel")


def test_parallel_multiple_mixes_functions() -> None:
    gt = [*WEATHER_GT[:1], AREA_GT[0]]
    calls = [{"geometry.area": {"base": 10, "height": 5}}, {"weather.get": {"city": "Boston", "unit": "Celsius"}}]
    assert verdict([WEATHER, AREA], calls, gt, "parallel_multiple")
    res = check_calls([WEATHER, AREA], [calls[0], calls[0]], gt, "live_parallel_multiple")
    assert not res.correct and "no other call to 'weather.get'" in res.error


@pytest.mark.parametrize(
    "calls",
    [
        [{"geometry.area": {"base": 10, "height": 5.0}, "other": {}}],
        [{"geometry.area": "base=10"}],
        ["geometry.area(base=10, height=5.0)"],
        [{None: {"base": 10, "height": 5.0}}],
    ],
)
def test_malformed_calls_are_incorrect_not_errors(calls: list) -> None:
    res = check_calls([AREA], calls, AREA_GT, "simple")
    assert not res.correct and res.error.startswith("malformed call")


def test_unknown_category_raises() -> None:
    with pytest.raises(PaskError, match=r"unknown BFCL category 'simple_python'.*live_parallel_multiple"):
        check_calls([AREA], [], AREA_GT, "simple_python")
    with pytest.raises(PaskError, match="choose from: simple, multiple"):
        load_possible_answers("irrelevance")


def test_bad_function_docs_and_answers_raise() -> None:
    odd = fn("f", {"x": {"type": "complex"}}, required=("x",))
    with pytest.raises(PaskError, match="unsupported BFCL type 'complex'"):
        check_calls([odd], [{"f": {"x": 1}}], [{"f": {"x": [1]}}], "simple")
    with pytest.raises(PaskError, match="does not offer"):
        check_calls([AREA], [{"g": {}}], [{"g": {}}], "simple")
    with pytest.raises(PaskError, match="exactly one ground-truth call"):
        check_calls([WEATHER], [{"weather.get": {"city": "Paris"}}], WEATHER_GT, "multiple")


# ---------------------------------------------------------------- properties without data

_WORD = st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789", min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(words=st.lists(_WORD, min_size=1, max_size=4), seps=st.lists(st.sampled_from([" ", ",", ".", "/", "-", "_"])))
def test_string_normalisation_property(words: list[str], seps: list[str]) -> None:
    allowed = " ".join(words)
    noisy = "".join(w.swapcase() + (seps[i % len(seps)] if seps else "") for i, w in enumerate(words))
    doc = fn("f", {"s": {"type": "string"}}, required=("s",))
    assert verdict([doc], [{"f": {"s": noisy}}], [{"f": {"s": [allowed]}}])


@settings(max_examples=60, deadline=None)
@given(n=st.integers(-(2**40), 2**40))
def test_int_for_float_property(n: int) -> None:
    doc = fn("f", {"x": {"type": "float"}}, required=("x",))
    assert verdict([doc], [{"f": {"x": n}}], [{"f": {"x": [float(n)]}}])
    assert not verdict([doc], [{"f": {"x": n + 1}}], [{"f": {"x": [float(n)]}}])


# ---------------------------------------------------------------- BFCL data


def _is_empty(v: Any) -> bool:
    return type(v) is str and v == ""


class Unsolvable(Exception):
    """The ground truth admits no call (e.g. an empty list of allowed values)."""


Chooser = Callable[[list], Any]


def _first(options: list) -> Any:
    return options[0]


_OMIT = object()  # a chooser's option: leave the parameter out


def _pick_params(params: dict[str, list], props: dict | None, required: list[str], choose: Chooser) -> dict:
    """Arguments from allowed values; ``choose`` picks among them, ``""`` becoming ``_OMIT`` where optional."""
    out = {}
    for req in required:
        if req not in params:
            raise Unsolvable(f"required '{req}' has no ground truth")
    for name, allowed in params.items():
        allowed = allowed if isinstance(allowed, list) else [allowed]
        omittable = any(_is_empty(v) for v in allowed) and name not in required
        if props is not None and name not in props:
            if omittable:
                continue
            raise Unsolvable(f"'{name}' is not a parameter")
        options = []
        for v in allowed:
            if not _is_empty(v):
                options.append(v)
            elif omittable and _OMIT not in options:
                options.append(_OMIT)
        if not options:
            if allowed and (props is None or props[name].get("type") in ("string", "any")):
                out[name] = ""  # a required string whose only allowed value is ""
                continue
            raise Unsolvable(f"'{name}' has no allowed value")
        picked = choose(options)
        if picked is _OMIT:
            continue
        out[name] = copy.deepcopy(picked)
        doc = props.get(name, {}) if props is not None else {}
        if doc.get("type") == "dict" and type(picked) is dict:
            out[name] = _pick_params(picked, None, [], choose)
        elif doc.get("type") == "array" and doc.get("items", {}).get("type") == "dict" and type(picked) is list:
            out[name] = [_pick_params(d, None, [], choose) if type(d) is dict else d for d in picked]
    return out


def build_calls(functions: list[dict], answer: list[dict], choose: Chooser = _first) -> list[dict]:
    """Calls satisfying the ground truth, in its order; ``choose`` picks values and omissions."""
    docs = {f["name"]: f for f in functions}
    calls = []
    for entry in answer:
        ((name, params),) = entry.items()
        p = docs[name]["parameters"]
        calls.append({name: _pick_params(params, p["properties"], p.get("required", []), choose)})
    return calls


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    category: str
    functions: list[dict]
    answer: list[dict]


def _file_stem(category: str) -> str:
    return "simple_python" if category == "simple" else category


@lru_cache(maxsize=1)
def all_cases() -> tuple[Case, ...]:
    cases = []
    for cat in CATEGORIES:
        answers = load_possible_answers(cat)
        with open(bfcl_data_dir() / f"BFCL_v4_{_file_stem(cat)}.json") as f:
            for line in f:
                row = json.loads(line)
                cases.append(Case(row["id"], cat, row["function"], answers[row["id"]]))
    return tuple(cases)


@lru_cache(maxsize=1)
def solvable_cases() -> tuple[Case, ...]:
    out = []
    for case in all_cases():
        try:
            calls = build_calls(case.functions, case.answer)
        except Unsolvable:
            continue
        if check_calls(case.functions, calls, case.answer, case.category).correct:
            out.append(case)
    return tuple(out)


@pytest.fixture(scope="module")
def bfcl_ast_checker() -> Iterator[Callable[..., dict]]:
    """bfcl-eval's own ``ast_checker``, imported with its heavy model-config module stubbed."""
    pytest.importorskip("bfcl_eval")
    stub = types.ModuleType("bfcl_eval.constants.model_config")
    stub.MODEL_CONFIG_MAPPING = {}  # type: ignore[attr-defined]
    saved = sys.modules.get(stub.__name__)
    sys.modules[stub.__name__] = stub
    try:
        mod = importlib.import_module("bfcl_eval.eval_checker.ast_eval.ast_checker")
        language = importlib.import_module("bfcl_eval.constants.enums").Language.PYTHON
    finally:
        if saved is None:
            sys.modules.pop(stub.__name__, None)
        else:
            sys.modules[stub.__name__] = saved
    old_mapping = mod.MODEL_CONFIG_MAPPING
    # underscore_to_dot=False: bfcl-eval compares the original dotted names, as ours does.
    mod.MODEL_CONFIG_MAPPING = {**old_mapping, BFCL_MODEL: types.SimpleNamespace(underscore_to_dot=False)}

    def run(case: Case, calls: list[dict]) -> dict:
        return mod.ast_checker(
            case.functions, copy.deepcopy(calls), case.answer, language, _file_stem(case.category), BFCL_MODEL
        )

    yield run
    mod.MODEL_CONFIG_MAPPING = old_mapping


def _wrong_value(v: Any) -> Any:
    if type(v) is str:
        return v + "zq"
    if type(v) is bool:
        return not v
    if type(v) is int:
        return v + 7
    if type(v) is float:
        return v + 0.75
    if type(v) is list:
        return [*v, v[-1]] if v else ["zq"]
    if type(v) is dict:
        return {**v, "zq": 1}
    return "zq"


def _wrong_type(v: Any) -> Any:
    if type(v) is str:
        return 12345
    if type(v) in (int, float, bool):
        return str(v)
    if type(v) in (list, dict):
        return json.dumps(v)
    return 0


def _lenient_calls(answer: list[dict]) -> list[dict]:
    """Calls from the first non-empty allowed value of every ground-truth parameter, whatever the docs say."""
    calls = []
    for entry in answer:
        ((name, params),) = entry.items()
        args = {}
        for key, allowed in params.items():
            values = [v for v in allowed if not _is_empty(v)]
            if values:
                args[key] = copy.deepcopy(values[0])
        calls.append({name: args})
    return calls


def _variants(case: Case) -> list[tuple[str, list[dict]]]:
    """Calls from the ground truth, and deliberately changed ones (mostly broken)."""
    try:
        base = build_calls(case.functions, case.answer)
    except Unsolvable:
        base = _lenient_calls(case.answer)
    docs = {f["name"]: f for f in case.functions}
    out = [("ground_truth", base)]
    if len(base) > 1:
        out.append(("reversed", base[::-1]))
    ((name, args),) = base[0].items()
    props = docs[name]["parameters"]["properties"]

    def first_changed(new_name: str, new_args: dict) -> list[dict]:
        return [{new_name: new_args}, *copy.deepcopy(base[1:])]

    required = [r for r in docs[name]["parameters"].get("required", []) if r in args]
    if required:
        out.append(("missing_required", first_changed(name, {k: v for k, v in args.items() if k != required[0]})))
    if args:
        key = required[0] if required else next(iter(args))
        out.append(("wrong_value", first_changed(name, {**args, key: _wrong_value(args[key])})))
        out.append(("wrong_type", first_changed(name, {**args, key: _wrong_type(args[key])})))
    for key, v in args.items():
        if props.get(key, {}).get("type") == "float" and type(v) is float and v.is_integer():
            out.append(("int_for_float", first_changed(name, {**args, key: int(v)})))
            break
    for key, v in args.items():
        if props.get(key, {}).get("type") == "string" and type(v) is str and v:
            out.append(("normalised_string", first_changed(name, {**args, key: "- " + v.upper() + " ."})))
            out.append(("empty_string", first_changed(name, {**args, key: ""})))
            break
    for key, v in args.items():
        if type(v) is list:
            out.append(("as_tuple", first_changed(name, {**args, key: tuple(v)})))
            out.append(("empty_list", first_changed(name, {**args, key: []})))
            break
    ((_, gt_params),) = case.answer[0].items()
    optional = {k for k, allowed in gt_params.items() if any(_is_empty(a) for a in allowed)}
    if optional & set(args):
        out.append(("omit_optional", first_changed(name, {k: v for k, v in args.items() if k not in optional})))
    out.append(("extra_arg", first_changed(name, {**args, "pask_unknown_arg": 1})))
    out.append(("wrong_name", first_changed(name + "_v2", args)))
    out.append(("wrong_count", base[:-1] if len(base) > 1 else [*base, *copy.deepcopy(base)]))
    return out


@requires_bfcl
def test_possible_answers_load_for_every_category() -> None:
    sizes = {cat: len(load_possible_answers(cat)) for cat in CATEGORIES}
    assert sizes["simple"] == 400 and sizes["live_parallel"] == 16
    answer = load_possible_answers("simple")["simple_python_0"]
    assert answer == [{"calculate_triangle_area": {"base": [10], "height": [5], "unit": ["units", ""]}}]
    assert len(all_cases()) == sum(sizes.values())


@requires_bfcl
def test_cross_check_against_bfcl_eval(bfcl_ast_checker: Callable[..., dict]) -> None:
    """Every case of the 8 categories, ground-truth calls and broken variants: verdicts must agree."""
    start = time.perf_counter()
    total, agree = 0, 0
    disagreements: list[str] = []
    ours_by_kind: Counter[tuple[str, bool]] = Counter()
    for case in all_cases():
        for kind, calls in _variants(case):
            ours = check_calls(case.functions, copy.deepcopy(calls), case.answer, case.category)
            theirs = bfcl_ast_checker(case, calls)["valid"]
            total += 1
            agree += ours.correct == theirs
            ours_by_kind[kind, ours.correct] += 1
            if ours.correct != theirs:
                disagreements.append(f"{case.id} [{kind}] ours={ours} bfcl={theirs} calls={json.dumps(calls)[:300]}")
    elapsed = time.perf_counter() - start
    rate = agree / total
    shown = disagreements[:40] + ([f"... and {len(disagreements) - 40} more"] if len(disagreements) > 40 else [])
    summary = f"agreement {agree}/{total} = {rate:.4%} in {elapsed:.1f}s; disagreements:\n" + "\n".join(shown)
    print(summary)
    assert total > 10_000
    assert rate >= 0.99, summary
    # The only known difference: bfcl-eval's greedy parallel matching rejects some correct orders.
    for line in disagreements:
        case_id = line.split(" ", 1)[0]
        assert case_id in KNOWN_GREEDY_CASES and "ours=CheckResult(correct=True" in line, summary
    # Sanity: the variants do what they are meant to.
    assert ours_by_kind["ground_truth", True] >= 0.99 * len(all_cases())
    for kind in ("missing_required", "extra_arg", "wrong_name", "wrong_count"):
        assert ours_by_kind[kind, True] == 0, kind
    assert ours_by_kind["wrong_value", False] > 0.95 * (
        ours_by_kind["wrong_value", False] + ours_by_kind["wrong_value", True]
    )


def _draw_chooser(data: st.DataObject) -> Chooser:
    return lambda options: data.draw(st.sampled_from(options))


_DATA_SETTINGS = settings(
    max_examples=80, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)


@requires_bfcl
@_DATA_SETTINGS
@given(data=st.data())
def test_calls_from_ground_truth_are_correct(data: st.DataObject) -> None:
    """Any allowed value, any permitted omission, any call order: judged correct."""
    cases = solvable_cases()
    case = cases[data.draw(st.integers(0, len(cases) - 1), label="case")]
    calls = build_calls(case.functions, case.answer, _draw_chooser(data))
    order = data.draw(st.permutations(range(len(calls))), label="order")
    res = check_calls(case.functions, [calls[i] for i in order], case.answer, case.category)
    assert res.correct, (case.id, res.error)


@requires_bfcl
@_DATA_SETTINGS
@given(data=st.data())
def test_removing_a_required_parameter_is_incorrect(data: st.DataObject) -> None:
    cases = solvable_cases()
    case = cases[data.draw(st.integers(0, len(cases) - 1), label="case")]
    calls = build_calls(case.functions, case.answer, _draw_chooser(data))
    docs = {f["name"]: f for f in case.functions}
    spots = [
        (i, r)
        for i, call in enumerate(calls)
        for name, args in call.items()
        for r in docs[name]["parameters"].get("required", [])
        if r in args
    ]
    if not spots:
        return
    i, req = data.draw(st.sampled_from(spots), label="removed")
    ((name, args),) = calls[i].items()
    calls[i] = {name: {k: v for k, v in args.items() if k != req}}
    res = check_calls(case.functions, calls, case.answer, case.category)
    assert not res.correct
    if len(calls) == 1:
        assert res.error == f"missing required parameter '{req}' in {name}"


@requires_bfcl
@_DATA_SETTINGS
@given(data=st.data(), extra=st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8))
def test_adding_an_unknown_parameter_is_incorrect(data: st.DataObject, extra: str) -> None:
    cases = solvable_cases()
    case = cases[data.draw(st.integers(0, len(cases) - 1), label="case")]
    calls = build_calls(case.functions, case.answer, _draw_chooser(data))
    i = data.draw(st.integers(0, len(calls) - 1), label="call")
    ((name, args),) = calls[i].items()
    props = next(f for f in case.functions if f["name"] == name)["parameters"]["properties"]
    if extra in props:
        return
    calls[i] = {name: {**args, extra: 1}}
    assert not verdict(case.functions, calls, case.answer, case.category)


@requires_bfcl
@_DATA_SETTINGS
@given(data=st.data())
def test_random_changes_agree_with_bfcl_eval(data: st.DataObject, bfcl_ast_checker: Callable[..., dict]) -> None:
    """Differential: a random value of a random argument changed (or not): same verdict as bfcl-eval."""
    cases = all_cases()
    case = cases[data.draw(st.integers(0, len(cases) - 1), label="case")]
    try:
        calls = build_calls(case.functions, case.answer, _draw_chooser(data))
    except Unsolvable:
        return
    i = data.draw(st.integers(0, len(calls) - 1), label="call")
    ((_, args),) = calls[i].items()
    if args:
        key = data.draw(st.sampled_from(sorted(args)), label="arg")
        change = data.draw(st.sampled_from(["keep", "value", "type", "drop", "empty"]), label="change")
        if change == "value":
            args[key] = _wrong_value(args[key])
        elif change == "type":
            args[key] = _wrong_type(args[key])
        elif change == "drop":
            del args[key]
        elif change == "empty":
            args[key] = data.draw(st.sampled_from(["", [], {}, None]), label="empty")
    ours = check_calls(case.functions, copy.deepcopy(calls), case.answer, case.category)
    theirs = bfcl_ast_checker(case, calls)["valid"]
    assert ours.correct == theirs or (case.id in KNOWN_GREEDY_CASES and ours.correct), (case.id, calls, ours)
