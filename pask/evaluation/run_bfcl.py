"""BFCL evaluation (compatibility names): :class:`pask.tasks.bfcl.BfclTask` through :mod:`pask.evaluation.runner`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pask.evaluation.runner import prepare as _prepare
from pask.evaluation.runner import run_task
from pask.runtime.models import LoadedModel
from pask.runtime.tokens import Request
from pask.tasks.bfcl import LIVE_ORDER, TABLE_ORDER, schema_valid, summarize, table_markdown
from pask.tasks.function_calling import FunctionCase
from pask.tasks.registry import get_task


def prepare(
    lm: LoadedModel, case: FunctionCase, max_new_tokens: int | None = None, tagging: bool = False
) -> tuple[Request, str | None]:
    """Prompt ids + grammar constraint (+ tagger, prompt labels) of a BFCL case; see ``runner.prepare``."""
    return _prepare(get_task("bfcl"), lm, case, max_new_tokens, tagging)


def run_bfcl(
    lm: LoadedModel,
    cases: list[FunctionCase],
    out_dir: Path,
    batch_size: int = 8,
    max_new_tokens: int | None = None,
    policy=None,
    progress: Callable[[int], None] | None = None,
    meta: dict | None = None,
    save_tags: bool = False,
    batching: str = "static",
) -> dict:
    """:func:`pask.evaluation.runner.run_task` on the BFCL task."""
    task = get_task("bfcl")
    return run_task(task, lm, cases, out_dir, batch_size, max_new_tokens, policy, progress, meta, save_tags, batching)


__all__ = ["LIVE_ORDER", "TABLE_ORDER", "prepare", "run_bfcl", "schema_valid", "summarize", "table_markdown"]
