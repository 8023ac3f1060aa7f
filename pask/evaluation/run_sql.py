"""Text-to-SQL evaluation (compatibility names): :class:`pask.tasks.sql.SqlTask` via :mod:`pask.evaluation.runner`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pask.evaluation.runner import prepare as _prepare
from pask.evaluation.runner import run_task
from pask.runtime.models import LoadedModel
from pask.runtime.tokens import Request
from pask.tasks.registry import get_task
from pask.tasks.sql import DEFAULT_MAX_NEW_TOKENS, database, select_cases, summarize, table_markdown
from pask.tasks.text_to_sql import Case


def prepare(
    lm: LoadedModel,
    case: Case,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    tagging: bool = False,
    data_dir: Path | str | None = None,
) -> tuple[Request, str | None]:
    """Prompt ids + the database's grammar constraint (+ tagger and prompt labels) of a text-to-SQL case."""
    return _prepare(get_task("sql"), lm, case, max_new_tokens, tagging, data_dir=data_dir)


def run_sql(
    lm: LoadedModel,
    cases: list[Case],
    out_dir: Path,
    batch_size: int = 8,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    policy=None,
    progress: Callable[[int], None] | None = None,
    meta: dict | None = None,
    save_tags: bool = False,
    data_dir: Path | str | None = None,
    batching: str = "static",
) -> dict:
    """:func:`pask.evaluation.runner.run_task` on the text-to-SQL task (``data_dir``: where the cases came from)."""
    task = get_task("sql")
    args = (batch_size, max_new_tokens, policy, progress, meta, save_tags, batching)
    return run_task(task, lm, cases, out_dir, *args, data_dir=data_dir)


__all__ = ["database", "prepare", "run_sql", "select_cases", "summarize", "table_markdown"]
