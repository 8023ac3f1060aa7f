"""The tasks calibration runs on: every task of the registry (:data:`pask.tasks.TASKS`).

One :class:`CalibrationTask` per task, built from the task (:class:`pask.tasks.Task`) and the
evaluation runner (:mod:`pask.evaluation.runner`). The control run, the sensitivity probes and the
dev check only go through it, so the calibration machinery is the same for every task.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from pask.errors import PaskError
from pask.tasks import TASKS, Task, task_names


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


def _load(task: Task, split: str, categories: list[str] | None, limit: int | None) -> tuple[list, list[str]]:
    """The cases to calibrate on and their categories (``[]`` for a task without them).

    ``split`` may join splits with ``+`` (``calibration+dev``: both, in that order; ``limit`` applies
    to each), e.g. to measure on more databases than the calibration split holds."""
    given = {}
    if categories:
        if "categories" not in task.options:
            raise PaskError(f"task {task.name} has no categories: drop --categories for --task {task.name}")
        given["categories"] = list(categories)
    options = task.resolve_options(given)
    parts = split.split("+")
    if "" in parts or len(set(parts)) != len(parts):
        raise PaskError(f"split '{split}': join distinct split names with '+', e.g. calibration+dev")
    cases = []
    for part in parts:
        task.check_fit(part, options)
        cases += task.cases(part, limit, **options)
    cats = list(options.get("categories") or [])
    if not cases:
        raise PaskError(f"no {task.name} cases in split '{split}'" + (f" for categories {cats}" if cats else ""))
    return cases, cats


def calibration_task(task: Task) -> CalibrationTask:
    """The calibration hooks of ``task`` (its default options, e.g. the bundled SQL data)."""
    from pask.evaluation import runner

    return CalibrationTask(
        name=task.name,
        load=partial(_load, task),
        prepare=lambda lm, c, m, tagging: runner.prepare(task, lm, c, m, tagging),
        score_row=lambda c, g, r: runner.case_row(task, c, g, r, save_tags=True),
        error_row=lambda c, req, err: runner.error_row(task, c, req, err),
        run=partial(runner.run_task, task),
        summarize=partial(runner.summarize, task),
        table_markdown=task.markdown,
        group=task.group,
    )


def get_task(name: str) -> CalibrationTask:
    """The calibration hooks of ``name`` (PaskError for a task the registry lacks)."""
    if name not in TASKS:
        raise PaskError(f"calibration supports tasks {', '.join(task_names())}, got '{name}'")
    return calibration_task(TASKS[name])


def default_max_new_tokens(task: str) -> int:
    """The evaluation's default generation allowance for ``task``."""
    if task not in TASKS:
        raise PaskError(f"unknown task '{task}'; known tasks: {', '.join(task_names())}")
    return TASKS[task].default_max_new_tokens


__all__ = ["CalibrationTask", "calibration_task", "default_max_new_tokens", "get_task"]
