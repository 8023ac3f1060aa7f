"""The tasks calibration runs on: how to load a split's cases, prepare, score and evaluate them.

One :class:`CalibrationTask` per task (``bfcl``: BFCL non-live function calling; ``sql``: Spider
dev text-to-SQL). The control run, the sensitivity probes and the dev check only go through it,
so the calibration machinery is the same for every task.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

from pask.errors import PaskError


@dataclass(frozen=True)
class CalibrationTask:
    """Task hooks used by calibration (rows are the task's per-case JSON rows, keyed by ``id``)."""

    name: str
    load: Callable[[str, list[str] | None, int | None], tuple[list, list[str]]]  # split, categories, limit
    prepare: Callable  # (lm, case, max_new_tokens, tagging) -> (Request, error or None)
    score_row: Callable  # (case, generation, request) -> row dict with tags and prompt labels
    error_row: Callable  # (case, request, error) -> row dict of a case that cannot run
    run: Callable  # run(lm, cases, out_dir, batch_size, max_new_tokens, policy, progress, meta) -> summary
    summarize: Callable[[list[dict]], dict]
    table_markdown: Callable[[dict, dict | None], str]
    group: Callable[[object], str]  # a case's group for screened sensitivity (BFCL category, SQL difficulty)


def _no_test(split: str) -> None:
    if split == "test":
        raise PaskError("calibrating on the test split would leak it: use --split calibration (or dev)")


def _bfcl() -> CalibrationTask:
    from pask.evaluation import run_bfcl as rb
    from pask.tasks.function_calling import LIVE, NON_LIVE, load_cases

    def load(split: str, categories: list[str] | None, limit: int | None) -> tuple[list, list[str]]:
        cats = list(categories or NON_LIVE)
        live = [c for c in cats if c in LIVE]
        if live:
            raise PaskError(f"live categories {live} are evaluation-only: never calibrate on them")
        _no_test(split)
        cases = load_cases(cats, split=split, limit=limit)
        if not cases:
            raise PaskError(f"no cases for categories {cats} in split '{split}'")
        return cases, cats

    def error_row(c, req, err: str) -> dict:
        n = len(req.prompt_ids)
        return asdict(rb.CaseResult(c.id, c.category, n, "", None, False, False, err, "schema_error", 0, 0, 0))

    return CalibrationTask(
        name="bfcl",
        load=load,
        prepare=lambda lm, c, m, tagging: rb.prepare(lm, c, m, tagging=tagging),
        score_row=lambda c, g, r: asdict(rb.score(c, g, r, save_tags=True)),
        error_row=error_row,
        run=rb.run_bfcl,
        summarize=rb.summarize,
        table_markdown=rb.table_markdown,
        group=lambda c: c.category,
    )


def _sql() -> CalibrationTask:
    from pask.evaluation import run_sql as rs

    def load(split: str, categories: list[str] | None, limit: int | None) -> tuple[list, list[str]]:
        if categories:
            raise PaskError("text-to-SQL has no categories: drop --categories for --task sql")
        _no_test(split)
        cases = rs.select_cases(split, limit)
        if not cases:
            raise PaskError(f"no text-to-SQL cases in split '{split}'")
        return cases, []

    def error_row(c, req, err: str) -> dict:
        n = len(req.prompt_ids)
        return asdict(rs.CaseResult(c.id, c.db_id, c.difficulty, n, "", False, err, "schema_error", 0, 0, 0))

    def score_row(c, g, r) -> dict:
        return asdict(rs.score(c, g, rs.database(c.db_id).path, r, save_tags=True))

    return CalibrationTask(
        name="sql",
        load=load,
        prepare=lambda lm, c, m, tagging: rs.prepare(lm, c, m, tagging=tagging),
        score_row=score_row,
        error_row=error_row,
        run=rs.run_sql,
        summarize=rs.summarize,
        table_markdown=rs.table_markdown,
        group=lambda c: c.difficulty,
    )


_TASKS: dict[str, Callable[[], CalibrationTask]] = {"bfcl": _bfcl, "sql": _sql}


def get_task(name: str) -> CalibrationTask:
    """The calibration hooks of ``name`` (PaskError for an unknown task)."""
    if name not in _TASKS:
        raise PaskError(f"calibration supports tasks {', '.join(sorted(_TASKS))}, got '{name}'")
    return _TASKS[name]()


def default_max_new_tokens(task: str) -> int:
    """The evaluation's default generation allowance for ``task``."""
    return 256 if task == "sql" else 384


__all__ = ["CalibrationTask", "default_max_new_tokens", "get_task"]
