"""RULER-style long-context tasks as a :class:`~pask.tasks.base.Task` (``pask eval ruler``).

Sub-tasks, seeds and data: :mod:`pask.tasks.ruler_data` (``niah_single``, ``niah_multikey``,
``niah_multivalue``, ``niah_multiquery``, ``vt``, ``cwe``, ``fwe`` from RULER, and pask's ``copy``);
prompts sized to the target token length with the model's tokenizer: :mod:`pask.tasks.ruler_prompt`.

Options: ``tasks`` (the sub-tasks, default all), ``length`` (the prompt's length in tokens, chat
template included; default 8192, 4096 / 8192 / 16384 documented, any value in [256, 131072]
accepted; ``copy`` needs >= 1024) and ``answer_format``: ``text`` (free text continuing RULER's
answer prefix), ``json`` (one call of a ``give_answer`` tool whose parameters are the answer's
schema: a list of strings, or a copied record's fields; decoded under the tool-call grammar, with
the JSON tagger and prompt labels) or ``auto`` (the default: JSON for a copied record, text for the
rest, the copied list included). ``limit``: N cases per sub-task (default 25 test / 10 dev / 25 calibration).

Scoring (RULER's ``string_match_all``): a case's ``score`` is the fraction of its reference strings
found in the answer, case-insensitive (``copy``: verbatim, case-sensitive); ``correct``: all found.
The answer is the output text, or for a JSON answer the items it gives, one per line (a copied
record's fields as ``key: value``); a JSON answer that does not parse (truncated) is scored on the
raw text and marked ``valid: false``. ``copy`` rows also say ``exact``: the reference lines appear
consecutively, in order, among the answer's non-empty lines (trailing spaces ignored, indentation
kept). The summary gives per sub-task the mean score in % (``score``), ``accuracy`` (% correct),
``n``, ``correct`` (and ``exact`` % for copy, also per variant); overall ``score`` is the mean of
the sub-task scores (RULER's average), ``accuracy`` the % of all cases correct.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from pask.errors import PaskError
from pask.structure.json_tagger import JsonCallTagger
from pask.structure.prompt_labels import label_prompt
from pask.structure.tags import PromptLabel
from pask.tasks.base import Output, Task, TaskRequest, measured_budgets, table_lines
from pask.tasks.function_calling import build_grammar, parse_calls
from pask.tasks.ruler_data import (
    COPY_VARIANTS,
    DEFAULT_LENGTH,
    SUBTASKS,
    RulerCase,
    check_answer_format,
    check_length,
    check_tasks,
    make_cases,
)
from pask.tasks.ruler_prompt import ANSWER_TOOL, answer_lines, answer_tool, build

DEFAULT_MAX_NEW_TOKENS = 512  # a copied item in JSON; RULER's own tasks need <= 128


# -- scoring ------------------------------------------------------------------------------------------------
def parse_answer(text: str) -> dict:
    """The arguments of the ``give_answer`` call in a JSON answer; PaskError when there is none."""
    calls = parse_calls(text)
    if not calls:
        raise PaskError("no tool call")
    ((name, args),) = calls[0].items()
    if name != ANSWER_TOOL or not isinstance(args, dict):
        raise PaskError(f"expected a call of {ANSWER_TOOL}, got {name}")
    return args


def missing(references: list[str] | tuple[str, ...], answer: str, verbatim: bool = False) -> list[str]:
    """The references not found in ``answer`` (substring; case-insensitive unless ``verbatim``,
    which also ignores a reference's surrounding spaces)."""
    if verbatim:
        return [r for r in references if r.strip() not in answer]
    low = answer.lower()
    return [r for r in references if r.lower() not in low]


def exact_block(references: list[str] | tuple[str, ...], answer: str) -> bool:
    """Whether the reference lines appear consecutively, in order, among the answer's non-empty lines
    (trailing spaces ignored)."""
    want = [r.rstrip() for r in references]
    lines = [x.rstrip() for x in answer.splitlines() if x.strip()]
    return any(lines[i : i + len(want)] == want for i in range(len(lines) - len(want) + 1))


def score_case(case: RulerCase, output: Output) -> dict:
    """A case's row fields: ``score``, ``found``, ``missing``, ``exact`` (copy; else None), ``valid``,
    ``correct``, ``error`` (see the module docstring)."""
    refs = list(case.references)
    copy = case.task == "copy"
    if output.error is not None:
        return {"score": 0.0, "found": 0, "missing": refs, "exact": False if copy else None, "valid": False,
                "correct": False, "error": output.error}  # fmt: skip
    answer, valid, error = output.text, True, None
    if case.answer_format == "json":
        if output.parse_error is None and isinstance(output.parsed, dict):
            answer = "\n".join(answer_lines(case, output.parsed))
        else:
            valid, error = False, output.parse_error or "no answer"
    lost = missing(refs, answer, verbatim=copy)
    return {
        "score": round((len(refs) - len(lost)) / len(refs), 4),
        "found": len(refs) - len(lost),
        "missing": lost,
        "exact": exact_block(refs, answer) if copy else None,
        "valid": valid,
        "correct": not lost,
        "error": error,
    }


# -- summary ------------------------------------------------------------------------------------------------
def _pct(part: float, whole: int) -> float | None:
    return round(100 * part / whole, 2) if whole else None


def _bucket(rows: list[dict]) -> dict:
    n = len(rows)
    out = {
        "n": n,
        "correct": sum(r["correct"] for r in rows),
        "score": _pct(sum(r["score"] for r in rows), n),
        "accuracy": _pct(sum(r["correct"] for r in rows), n),
    }
    exact = [r["exact"] for r in rows if r.get("exact") is not None]
    if exact:
        out["exact"] = _pct(sum(exact), len(exact))
    return out


def summarize(rows: list[dict]) -> dict:
    """Per sub-task (copy also per variant) and overall scores in %; overall ``score`` is the mean
    of the sub-task scores."""
    names = [t for t in SUBTASKS if any(r["task"] == t for r in rows)]
    names += sorted({r["task"] for r in rows} - set(names))
    tasks = {t: _bucket([r for r in rows if r["task"] == t]) for t in names}
    if "copy" in tasks:
        copies = [r for r in rows if r["task"] == "copy"]
        tasks["copy"]["variants"] = {
            v: _bucket([r for r in copies if r.get("variant") == v])
            for v in COPY_VARIANTS
            if any(r.get("variant") == v for r in copies)
        }
    scores = [b["score"] for b in tasks.values()]
    overall = {
        "n": len(rows),
        "correct": sum(r["correct"] for r in rows),
        "score": round(sum(scores) / len(scores), 2) if scores else None,
        "accuracy": _pct(sum(r["correct"] for r in rows), len(rows)),
        "valid": sum(r["valid"] for r in rows),
        "truncated": sum(r["stop_reason"] == "length" for r in rows),
        "schema_errors": sum(r["stop_reason"] == "schema_error" for r in rows),
    }
    return {"tasks": tasks, "overall": overall, **measured_budgets(rows)}


def table_markdown(summary: dict, meta: dict | None = None) -> str:
    """One row: the score (%) of each sub-task and their mean (Avg), measured B; the n row below."""
    meta = meta or {}
    tasks, o = summary["tasks"], summary["overall"]

    def pct(x: float | None) -> str:
        return "–" if x is None else f"{x:.2f}"

    head = ["Model", "Method", "B", *tasks, "Avg"]
    cells = [meta.get("model", "?"), meta.get("policy", "?"), f"{summary['measured_b']:.3f}"]
    cells += [pct(b["score"]) for b in tasks.values()] + [pct(o["score"])]
    ns = ["", "", "n", *[str(b["n"]) for b in tasks.values()], str(o["n"])]
    lines = table_lines(head, cells, ns, meta)
    length = f" at {meta['length']} tokens" if meta.get("length") else ""
    lines.append(
        f"Score{length}: RULER's string-match recall in % (per case the share of reference strings found in "
        "the answer, case-insensitive; copy: verbatim), averaged over cases; Avg: the mean over the sub-tasks."
    )
    note = f"All references found: {o['correct']}/{o['n']}"
    if "copy" in tasks and "exact" in tasks["copy"]:
        per = ", ".join(f"{v} {pct(b.get('exact'))}" for v, b in tasks["copy"].get("variants", {}).items())
        note += f"; copy exact: {pct(tasks['copy']['exact'])}% ({per})"
    lines.append(
        f"{note}; invalid JSON answers: {o['n'] - o['valid']}; truncated at max_new_tokens: {o['truncated']}; "
        f"schema errors: {o['schema_errors']}."
    )
    return "\n".join(lines) + "\n"


# -- the task -----------------------------------------------------------------------------------------------
class RulerTask(Task):
    """RULER-style synthetic long-context tasks (see the module docstring)."""

    name = "ruler"
    options: ClassVar[dict[str, Any]] = {"tasks": list(SUBTASKS), "length": DEFAULT_LENGTH, "answer_format": "auto"}
    default_max_new_tokens = DEFAULT_MAX_NEW_TOKENS
    score_key = "score"

    def cases(
        self,
        split: str,
        limit: int | None = None,
        tasks: list[str] | None = None,
        length: int = DEFAULT_LENGTH,
        answer_format: str = "auto",
    ) -> list[RulerCase]:
        names = check_tasks(list(SUBTASKS) if tasks is None else tasks)
        return make_cases(split, limit, names, check_length(length), check_answer_format(answer_format))

    def request(self, case: RulerCase, tokenizer: Any, tagging: bool = False, **options: Any) -> TaskRequest:
        """The case's prompt at its length. Text: no grammar; every prompt token protected_content.
        JSON: the ``give_answer`` tool-call grammar, the JSON tagger and the tool prompt's labels."""
        prompt = build(case, tokenizer)
        if case.answer_format == "text":
            labels = [PromptLabel.PROTECTED_CONTENT] * len(prompt.ids) if tagging else None
            return TaskRequest(prompt.ids, prompt_labels=labels)
        tool = answer_tool(case)
        req = TaskRequest(prompt.ids, build_grammar([tool], tokenizer, max_calls=1), parse=parse_answer)
        if tagging:
            req.tagger = JsonCallTagger([tool])
            req.prompt_labels = label_prompt(tokenizer, prompt.text, [tool])
        return req

    def case_fields(self, case: RulerCase) -> dict:
        return {
            "id": case.id,
            "task": case.task,
            "variant": case.variant or None,
            "length": case.length,
            "answer_format": case.answer_format,
            "depths": case.depths,
        }

    def check(self, case: RulerCase, output: Output, **options: Any) -> dict:
        return score_case(case, output)

    def summarize(self, rows: list[dict]) -> dict:
        return summarize(rows)

    def markdown(self, summary: dict, meta: dict | None = None) -> str:
        return table_markdown(summary, meta)

    def group(self, case: RulerCase) -> str:
        return case.task

    def run_record(self, limit: int | None, options: Mapping[str, Any]) -> dict:
        return {
            "limit": limit,
            "tasks": list(options["tasks"]),
            "length": options["length"],
            "answer_format": options["answer_format"],
        }


__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "RulerTask",
    "exact_block",
    "missing",
    "parse_answer",
    "score_case",
    "summarize",
    "table_markdown",
]
