"""BFCL function calling as a :class:`~pask.tasks.base.Task` (``pask eval bfcl``; paper Table 1 layout).

A case's prompt is its messages and tools through the model's chat template; decoding follows the
tool-call grammar of the offered tools (:func:`pask.tasks.function_calling.build_grammar`); the
parsed calls are checked with BFCL's AST rules (:mod:`pask.tasks.bfcl_checker`) after an
independent JSON-schema check (:func:`schema_valid`). Summaries give accuracy per category and
overall.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any, ClassVar

import jsonschema

from pask.errors import PaskError
from pask.structure.json_tagger import JsonCallTagger
from pask.structure.prompt_labels import label_prompt
from pask.tasks.base import COMMON_SPLITS, Output, Task, TaskRequest, measured_budgets, table_lines
from pask.tasks.bfcl_checker import check_calls
from pask.tasks.function_calling import (
    LIVE,
    NON_LIVE,
    FunctionCase,
    build_grammar,
    build_prompt,
    load_cases,
    parse_calls,
)

TABLE_ORDER = ("simple", "multiple", "parallel", "parallel_multiple")
LIVE_ORDER = ("live_simple", "live_multiple", "live_parallel", "live_parallel_multiple")
DEFAULT_MAX_NEW_TOKENS = 384


def schema_valid(case: FunctionCase, text: str) -> str | None:
    """Independent check (jsonschema) that every call names an offered tool and fits its schema."""
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in case.tools}
    calls = parse_calls(text)  # legal names
    if not calls:
        return "no tool call"
    for call in calls:
        ((name, args),) = call.items()
        if name not in tools:
            return f"unknown function {name}"
        try:
            jsonschema.validate(args, tools[name])
        except jsonschema.ValidationError as e:
            return f"schema violation in {name}: {e.message}"
    return None


def summarize(rows: list[dict]) -> dict:
    """Per-category accuracy (%) + Overall (mean over cases), validity and measured budget."""
    cats: dict[str, list[dict]] = {}
    for r in rows:
        cats.setdefault(r["category"], []).append(r)
    per = {}
    for cat, rs in cats.items():
        per[cat] = {
            "n": len(rs),
            "correct": sum(r["correct"] for r in rs),
            "accuracy": round(100 * sum(r["correct"] for r in rs) / len(rs), 2),
            "valid": sum(r["valid"] for r in rs),
        }
    n = len(rows)
    return {
        "categories": per,
        "overall": {
            "n": n,
            "correct": sum(r["correct"] for r in rows),
            "accuracy": round(100 * sum(r["correct"] for r in rows) / n, 2) if n else 0.0,
            "valid": sum(r["valid"] for r in rows),
            "schema_errors": sum(r["stop_reason"] == "schema_error" for r in rows),
        },
        **measured_budgets(rows),
    }


def table_markdown(summary: dict, meta: dict | None = None) -> str:
    """Markdown in the layout of the paper's Table 1 (per category + Overall)."""
    meta = meta or {}
    cats = [c for c in (*TABLE_ORDER, *LIVE_ORDER) if c in summary["categories"]]
    head = ["Model", "Method", "B", *cats, "Overall"]
    cells = [
        meta.get("model", "?"),
        meta.get("policy", "?"),
        f"{summary['measured_b']:.3f}",
        *[f"{summary['categories'][c]['accuracy']:.2f}" for c in cats],
        f"{summary['overall']['accuracy']:.2f}",
    ]
    ns = ["", "", "n", *[str(summary["categories"][c]["n"]) for c in cats], str(summary["overall"]["n"])]
    lines = table_lines(head, cells, ns, meta)
    o = summary["overall"]
    lines.append(f"Valid outputs: {o['valid']}/{o['n']}; schema errors: {o['schema_errors']}.")
    return "\n".join(lines) + "\n"


class BfclTask(Task):
    """BFCL function calling: ``categories`` (default the four non-live ones), ``limit`` per category."""

    name = "bfcl"
    splits = (*COMMON_SPLITS, "all")
    options: ClassVar[dict[str, Any]] = {"categories": list(NON_LIVE)}
    default_max_new_tokens = DEFAULT_MAX_NEW_TOKENS
    score_key = "accuracy"

    def cases(self, split: str, limit: int | None = None, categories: list[str] | None = None) -> list[FunctionCase]:
        return load_cases(list(categories if categories is not None else NON_LIVE), split=split, limit=limit)

    def request(self, case: FunctionCase, tokenizer: Any, tagging: bool = False, **options: Any) -> TaskRequest:
        prompt = build_prompt(tokenizer, case)
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        req = TaskRequest(ids, build_grammar(case.tools, tokenizer), parse=partial(parse_calls, name_map=case.name_map))
        if tagging:
            req.tagger = JsonCallTagger(case.tools)
            req.prompt_labels = label_prompt(tokenizer, prompt, case.tools)
        return req

    def case_fields(self, case: FunctionCase) -> dict:
        return {"id": case.id, "category": case.category}

    def check(self, case: FunctionCase, output: Output, **options: Any) -> dict:
        """Calls parsed, within the offered schemas (``valid``) and matching a possible answer (``correct``)."""
        if output.error is not None:
            return {"calls": None, "correct": False, "valid": False, "error": output.error}
        calls = output.parsed if output.parse_error is None else None
        error = output.parse_error
        valid_err = None if output.stop_reason != "length" else "output truncated at max_new_tokens"
        if valid_err is None and error is None:
            valid_err = schema_valid(case, output.text)
        correct = False
        if calls is not None and valid_err is None:
            res = check_calls(case.functions, calls, case.possible_answer or [], case.category)
            correct, error = res.correct, res.error
        valid = valid_err is None and output.parse_error is None
        return {"calls": calls, "correct": correct, "valid": valid, "error": error or valid_err}

    def summarize(self, rows: list[dict]) -> dict:
        return summarize(rows)

    def markdown(self, summary: dict, meta: dict | None = None) -> str:
        return table_markdown(summary, meta)

    def group(self, case: FunctionCase) -> str:
        return case.category

    def check_fit(self, split: str, options: Mapping[str, Any]) -> None:
        """Live categories are evaluation-only; the test split is never fitted on."""
        if live := [c for c in options.get("categories") or () if c in LIVE]:
            raise PaskError(f"live categories {live} are evaluation-only: never calibrate on them")
        super().check_fit(split, options)

    def run_record(self, limit: int | None, options: Mapping[str, Any]) -> dict:
        return {"categories": list(options["categories"])}


__all__ = ["DEFAULT_MAX_NEW_TOKENS", "LIVE_ORDER", "TABLE_ORDER", "BfclTask", "schema_valid", "summarize"]
