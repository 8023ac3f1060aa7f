"""BFCL AST checker (Python semantics), written for pask; cross-checked against bfcl-eval's.

A model's calls, in BFCL's ``[{"name": {"arg": value, ...}}, ...]`` form with the
original (dotted) function names, are judged against a case's possible answer:
``[{"name": {"arg": [allowed values...]}}, ...]``.

Rules, per call:

* the function name must be the expected one;
* every parameter the function doc marks required must be present;
* every given parameter must be in the doc's ``properties`` and in the possible answer;
* a ground-truth parameter may be left out only if ``""`` is among its allowed values;
* the value must have the declared type (``int`` is fine for ``float``; list elements are
  checked against ``items``) and be among the allowed values.

Values are compared as BFCL does: strings after :func:`normalize_string`; lists
element-wise (top-level string elements normalised); dicts key by key against the
allowed values of each key; lists of dicts dict by dict, in order. Following BFCL, when
the allowed values are of another Python type than the declared one (BFCL uses this for
variable names such as ``"data['sales']"``), a value of that other type is accepted as a
literal and compared exactly. An empty string / empty list / empty list of dicts is
accepted where ``""`` (omission) is allowed, as in BFCL.

Categories: ``simple``/``live_simple`` and ``multiple``/``live_multiple`` expect exactly
one call; the parallel categories expect as many calls as ground-truth entries, matched
order-free one to one (a maximum matching; bfcl-eval matches greedily in ground-truth
order, which can reject a correct answer in rare overlapping cases).
"""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pask.errors import PaskError

CATEGORIES: tuple[str, ...] = (
    "simple",
    "multiple",
    "parallel",
    "parallel_multiple",
    "live_simple",
    "live_multiple",
    "live_parallel",
    "live_parallel_multiple",
)

_SINGLE_CALL = frozenset({"simple", "multiple", "live_simple", "live_multiple"})

# BFCL's declared types → the Python type a value must have.
_PY_TYPES: dict[str, type] = {
    "string": str,
    "integer": int,
    "float": float,
    "boolean": bool,
    "array": list,
    "tuple": list,
    "dict": dict,
    "any": str,
}

_STRIP_RE = re.compile(r"[ ,./\-_*^]")
_OMITTED = ""  # marks an optional parameter in a possible answer


@dataclass(frozen=True)
class CheckResult:
    """Verdict for one case: ``error`` is a short reason when ``correct`` is false."""

    correct: bool
    error: str | None = None


def _check_category(category: str) -> None:
    if category not in CATEGORIES:
        raise PaskError(f"unknown BFCL category '{category}'; choose from: {', '.join(CATEGORIES)}")


def bfcl_data_dir() -> Path:
    """The ``data`` folder of the installed ``bfcl_eval`` package (found without importing it)."""
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        raise PaskError("bfcl-eval is not installed; install it with: pip install --no-deps bfcl-eval==2026.3.23")
    data = Path(next(iter(spec.submodule_search_locations))) / "data"
    if not data.is_dir():
        raise PaskError(f"bfcl-eval has no data folder at {data}")
    return data


def _file_stem(category: str) -> str:
    return "simple_python" if category == "simple" else category


def load_possible_answers(category: str) -> dict[str, list[dict]]:
    """Case id → ground truth (list of ``{name: {param: [allowed values]}}``) for a category."""
    _check_category(category)
    path = bfcl_data_dir() / "possible_answer" / f"BFCL_v4_{_file_stem(category)}.json"
    if not path.is_file():
        raise PaskError(f"missing BFCL possible-answer file {path}")
    out: dict[str, list[dict]] = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                out[row["id"]] = row["ground_truth"]
    return out


def normalize_string(s: str) -> str:
    """BFCL's string normalisation: drop spaces and ``,./-_*^``, lowercase, ``'`` → ``"``."""
    return _STRIP_RE.sub("", s).lower().replace("'", '"')


def _norm(x: Any) -> Any:
    """Normalise strings (exact type ``str``), leave anything else as it is."""
    return normalize_string(x) if type(x) is str else x


def _reference_type(allowed: list) -> type | None:
    """Python type of the first allowed value that is not the omission marker."""
    for a in allowed:
        if not (type(a) is str and a == _OMITTED):
            return type(a)
    return None


def _is_omitted(a: Any) -> bool:
    return type(a) is str and a == _OMITTED


def _elements_typed(value: list, inner: type, allowed: list) -> bool:
    """Element types of a list value: fine against at least one allowed value.

    An allowed value that is not a list (e.g. ``""``) constrains nothing; against an
    allowed list, each element must have the ``items`` type or the type of that list's
    first non-omitted element.
    """
    for a in allowed:
        if type(a) is not list:
            return True
        ref = _reference_type(a)
        if all(type(v) is inner or (ref is not None and type(v) is ref) for v in value):
            return True
    return False


def _options(opts: Any) -> list:
    return opts if isinstance(opts, list) else [opts]


def _dict_matches(value: Any, allowed: list) -> bool:
    """A dict value against allowed dicts ``{key: [allowed values]}`` (``""`` entries skipped)."""
    if type(value) is not dict:
        return False
    for a in allowed:
        if type(a) is not dict:
            continue
        keys_ok = all(k in a and _norm(v) in [_norm(o) for o in _options(a[k])] for k, v in value.items())
        if keys_ok and all(k in value or _OMITTED in _options(opts) for k, opts in a.items()):
            return True
    return False


def _dict_list_matches(value: list, allowed: list) -> bool:
    """A list of dicts against allowed lists of dicts, position by position (``""`` = empty list)."""
    for a in allowed:
        cand = [] if _is_omitted(a) else a
        if type(cand) is not list or len(cand) != len(value):
            continue
        if all(_dict_matches(v, [c]) for v, c in zip(value, cand, strict=True)):
            return True
    return False


def _list_matches(value: list, allowed: list) -> bool:
    """A list value against allowed lists, string elements normalised (``""`` = empty list)."""
    got = [_norm(v) for v in value]
    for a in allowed:
        cand = [] if _is_omitted(a) else a
        if type(cand) is list and got == [_norm(c) for c in cand]:
            return True
    return False


def _declared(doc: dict, where: str) -> tuple[str, type]:
    declared = doc.get("type") if isinstance(doc, dict) else None
    if declared not in _PY_TYPES:
        raise PaskError(f"unsupported BFCL type {declared!r} for {where}; known: {', '.join(_PY_TYPES)}")
    return declared, _PY_TYPES[declared]


def _check_value(fname: str, pname: str, value: Any, doc: dict, allowed: list) -> str | None:
    """Type and value check of one argument; an error message or ``None``."""
    where = f"'{pname}' in {fname}"
    declared, expected = _declared(doc, f"parameter {where}")
    inner: type | None = None
    if declared in ("array", "tuple") and isinstance(doc.get("items"), dict):
        inner = _declared(doc["items"], f"the items of {where}")[1]
    if not isinstance(allowed, list):
        allowed = [allowed]

    if declared == "tuple" and type(value) is tuple:
        value = list(value)
    if declared == "float" and type(value) is int:
        value = float(value)

    ref = _reference_type(allowed)
    literal = ref is not None and ref is not expected
    if type(value) is expected:
        if inner is not None and not _elements_typed(value, inner, allowed):
            return f"wrong element type in {where}: expected {declared} of {doc['items'].get('type')}"
    elif ref is not None and type(value) is ref:
        literal = True
    else:
        return f"wrong type for {where}: expected {declared}, got {type(value).__name__}"

    if literal:
        ok = value in allowed
    elif expected is dict:
        ok = _dict_matches(value, allowed)
    elif expected is list and inner is dict:
        ok = _dict_list_matches(value, allowed)
    elif expected is str:
        ok = normalize_string(value) in {normalize_string(a) for a in allowed if type(a) is str}
    elif expected is list:
        ok = _list_matches(value, allowed)
    else:
        ok = value in allowed
    return None if ok else f"invalid value for {where}: {value!r}"


def _check_call(doc: dict, name: str, args: dict, expected: dict[str, list]) -> str | None:
    """One call against one ground-truth entry; an error message or ``None``."""
    fname = doc["name"]
    if name != fname:
        return f"expected function '{fname}', got '{name}'"
    params = doc.get("parameters") or {}
    props = params.get("properties") or {}
    for req in params.get("required") or []:
        if req not in args:
            return f"missing required parameter '{req}' in {fname}"
    for pname, value in args.items():
        if pname not in props:
            return f"unknown parameter '{pname}' in {fname}"
        if pname not in expected:
            return f"unexpected parameter '{pname}' in {fname} (not in the ground truth)"
        err = _check_value(fname, pname, value, props[pname], expected[pname])
        if err:
            return err
    for pname, allowed in expected.items():
        if pname not in args and _OMITTED not in _options(allowed):
            return f"missing parameter '{pname}' in {fname}"
    return None


def _unpack_entry(entry: Any, what: str) -> tuple[Any, Any]:
    if not isinstance(entry, dict) or len(entry) != 1:
        raise ValueError(f"{what} must be a dict with exactly one function name, got {entry!r}")
    return next(iter(entry.items()))


def _max_matching(ok: list[list[bool]]) -> list[int | None]:
    """Maximum bipartite matching (rows → columns); the matched column per row or ``None``."""
    owner: dict[int, int] = {}

    def augment(row: int, seen: set[int]) -> bool:
        for col, good in enumerate(ok[row]):
            if good and col not in seen:
                seen.add(col)
                if col not in owner or augment(owner[col], seen):
                    owner[col] = row
                    return True
        return False

    for row in range(len(ok)):
        augment(row, set())
    match: list[int | None] = [None] * len(ok)
    for col, row in owner.items():
        match[row] = col
    return match


def check_calls(
    functions: list[dict], calls: list[dict[str, dict]], possible_answer: list[dict], category: str
) -> CheckResult:
    """Judge a case's parsed calls against its possible answer with BFCL's AST rules (Python)."""
    _check_category(category)
    docs = {f["name"]: f for f in functions}
    expected: list[tuple[dict, dict]] = []
    for i, entry in enumerate(possible_answer):
        try:
            gname, gparams = _unpack_entry(entry, f"ground-truth entry {i}")
        except ValueError as e:
            raise PaskError(str(e)) from None
        if gname not in docs:
            raise PaskError(f"ground truth names function '{gname}', which the case does not offer")
        expected.append((docs[gname], gparams if isinstance(gparams, dict) else {}))
    if category in _SINGLE_CALL and len(expected) != 1:
        raise PaskError(f"a {category} case needs exactly one ground-truth call, got {len(expected)}")

    if not isinstance(calls, list):
        return CheckResult(False, f"calls must be a list, got {type(calls).__name__}")
    parsed: list[tuple[str, dict]] = []
    for j, call in enumerate(calls):
        try:
            name, args = _unpack_entry(call, f"call {j}")
        except ValueError as e:
            return CheckResult(False, f"malformed call: {e}")
        if not isinstance(name, str) or not isinstance(args, dict):
            return CheckResult(False, f"malformed call {j}: {call!r}")
        parsed.append((name, args))

    if len(parsed) != len(expected):
        n = len(expected)
        return CheckResult(False, f"expected {n} call{'s' if n != 1 else ''}, got {len(parsed)}")

    errors = [[_check_call(doc, name, args, gparams) for name, args in parsed] for doc, gparams in expected]
    if len(expected) == 1:
        return CheckResult(errors[0][0] is None, errors[0][0])
    match = _max_matching([[e is None for e in row] for row in errors])
    if None not in match:
        return CheckResult(True, None)
    i = match.index(None)
    fname = expected[i][0]["name"]
    left = [j for j in range(len(parsed)) if j not in match]
    same = [j for j in left if parsed[j][0] == fname]
    reason = f"call {same[0]}: {errors[i][same[0]]}" if same else f"no other call to '{fname}'"
    return CheckResult(False, f"no call matches ground-truth call {i} ({fname}); {reason}")
