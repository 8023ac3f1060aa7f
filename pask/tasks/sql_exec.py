"""Execution accuracy of predicted SQL (BIRD's rule) on read-only SQLite connections.

A prediction is correct iff the *set* of its result rows equals the set of the gold query's
rows: row order and duplicate rows are ignored, column order matters (rows are tuples), and
values compare as Python values (``1 == 1.0``). A prediction that fails, runs past the timeout
or returns more than ``max_rows`` rows scores 0, with the reason in ``ExecResult.error``.

Both queries run on a connection opened with ``mode=ro`` and ``PRAGMA query_only=ON``, with
ATTACH disabled (it would open or create other files read-write) and an authorizer that allows
only reading: SELECT, column reads, function calls and recursive CTEs. Text is decoded as UTF-8
with replacement characters.
Bad inputs raise :class:`pask.errors.PaskError`: unknown db_id, missing or non-SQLite database
file, and a gold query that does not run (the data, not the prediction, is wrong then).
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from pask.errors import PaskError
from pask.structure.sql_schema import connect_readonly
from pask.tasks.text_to_sql import db_path

DEFAULT_TIMEOUT_S = 30.0
MAX_ROWS = 1_000_000
_PROGRESS_STEPS = 1000  # SQLite VM instructions between deadline checks
_FETCH_BATCH = 10_000
_ALLOWED_ACTIONS = frozenset(
    {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
)


@dataclass(frozen=True)
class ExecResult:
    """``correct``: the prediction's rows match; ``error``: why it was not compared, else None."""

    correct: bool
    error: str | None = None


class QueryFailed(Exception):
    """A query raised an error, timed out or returned too many rows."""


def run_query(path: Path, sql: str, timeout_s: float = DEFAULT_TIMEOUT_S, max_rows: int = MAX_ROWS) -> list[tuple]:
    """All result rows of ``sql`` on a read-only connection to ``path``.

    Raises :class:`PaskError` for a missing or non-SQLite file, :class:`QueryFailed` when the
    query fails, runs longer than ``timeout_s`` seconds or returns more than ``max_rows`` rows.
    """
    conn = connect_readonly(path)
    conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
    conn.set_authorizer(_authorize)
    deadline = time.monotonic() + timeout_s
    conn.set_progress_handler(lambda: int(time.monotonic() > deadline), _PROGRESS_STEPS)
    try:
        cursor = conn.execute(sql)
        rows: list[tuple] = []
        while batch := cursor.fetchmany(_FETCH_BATCH):
            rows.extend(batch)
            if len(rows) > max_rows:
                raise QueryFailed(f"more than {max_rows} rows")
        return rows
    except (sqlite3.Error, ValueError, OverflowError) as e:
        if time.monotonic() > deadline:
            raise QueryFailed(f"timeout after {timeout_s:g} s") from e
        raise QueryFailed(f"{type(e).__name__}: {e}") from e
    finally:
        conn.close()


def _authorize(action: int, *_: object) -> int:
    return sqlite3.SQLITE_OK if action in _ALLOWED_ACTIONS else sqlite3.SQLITE_DENY


def rows_match(pred_rows: list[tuple], gold_rows: list[tuple]) -> bool:
    """BIRD's comparison: equal sets of rows."""
    return set(pred_rows) == set(gold_rows)


def execution_match(
    path: Path, pred_sql: str, gold_sql: str, timeout_s: float = DEFAULT_TIMEOUT_S, max_rows: int = MAX_ROWS
) -> ExecResult:
    """Score ``pred_sql`` against ``gold_sql`` on the SQLite file ``path``."""
    try:
        gold_rows = run_query(path, gold_sql, timeout_s, max_rows)
    except QueryFailed as e:
        raise PaskError(f"gold query fails on {path}: {e}\n  {gold_sql}") from e
    try:
        pred_rows = run_query(path, pred_sql, timeout_s, max_rows)
    except QueryFailed as e:
        return ExecResult(False, str(e))
    return ExecResult(rows_match(pred_rows, gold_rows))


def execution_accuracy(
    pred_sql: str,
    gold_sql: str,
    db_id: str,
    data_dir: Path | str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> ExecResult:
    """Score ``pred_sql`` against ``gold_sql`` on database ``db_id`` of a text-to-SQL data directory."""
    return execution_match(db_path(db_id, data_dir), pred_sql, gold_sql, timeout_s)
