"""Execution accuracy of predicted SQL (BIRD's rule) on read-only SQLite connections.

A prediction is correct iff the *set* of its result rows equals the set of the gold query's
rows: row order and duplicate rows are ignored, column order matters (rows are tuples), and
values compare as Python values (``1 == 1.0``). A prediction that fails, runs past the timeout
or whose result goes over a cap scores 0, with the reason in ``ExecResult.error`` (the case row's
``error``, e.g. ``"result over 100000 rows"``).

Results are capped so that no query can take the evaluation's memory: at most :data:`MAX_ROWS`
rows and :data:`MAX_BYTES` bytes (estimated with ``sys.getsizeof`` over the Python rows, an upper
bound) are kept per query, and no single text or blob value may be longer than :data:`MAX_BYTES`
(``SQLITE_LIMIT_LENGTH``). Rows are fetched in chunks of at most :data:`_FETCH_CELLS` values and
fetching stops as soon as a cap is passed, so an allowed 8-way cross join costs a few MiB, not
GiBs. The timeout is a SQLite progress handler (checked every :data:`_PROGRESS_STEPS` VM
instructions, also while rows are fetched). A gold query whose result goes over a cap (or runs
out of memory) is not an error of the data: the case is recorded as not compared
(``"gold query result over ...: not compared"``, scored 0) instead of stopping the evaluation.

``ExecResult.gold_empty`` says whether the gold query returned no rows: any prediction that also
returns none (a wrong WHERE clause, say) scores correct on such a case, so EX is reported with and
without them (:func:`pask.tasks.sql.summarize`). A gold result over a cap counts as non-empty.

Both queries run on a connection opened with ``mode=ro`` and ``PRAGMA query_only=ON``, with
ATTACH disabled (it would open or create other files read-write) and an authorizer that allows
only reading: SELECT, column reads, function calls and recursive CTEs. Text is decoded as UTF-8
with replacement characters.
Bad inputs raise :class:`pask.errors.PaskError`: unknown db_id, missing or non-SQLite database
file, and a gold query that does not run (the data, not the prediction, is wrong then).
"""

from __future__ import annotations

import itertools
import sqlite3
import sys
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from pask.errors import PaskError
from pask.structure.sql_schema import connect_readonly
from pask.tasks.text_to_sql import db_path

DEFAULT_TIMEOUT_S = 30.0
MAX_ROWS = 100_000  # result rows kept per query; more is a failed execution
MAX_BYTES = 64 << 20  # estimated bytes of a query's result rows (and longest text/blob value)
_PROGRESS_STEPS = 1000  # SQLite VM instructions between deadline checks
_FETCH_ROWS = 10_000  # rows per fetchmany ...
_FETCH_CELLS = 100_000  # ... and at most this many values (wide rows: fewer rows per chunk)
_ALLOWED_ACTIONS = frozenset(
    {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
)


@dataclass(frozen=True)
class ExecResult:
    """``correct``: the prediction's rows match; ``error``: why it was not compared, else None;
    ``gold_empty``: the gold query returned no rows (None where the gold query did not run)."""

    correct: bool
    error: str | None = None
    gold_empty: bool | None = None


class QueryFailed(Exception):
    """A query raised an error, timed out or its result went over a cap.

    ``kind``: ``"error"``, ``"timeout"`` or ``"cap"`` (too many rows or bytes, or out of memory).
    """

    def __init__(self, message: str, kind: str = "error") -> None:
        super().__init__(message)
        self.kind = kind


def result_bytes(rows: list[tuple]) -> int:
    """Estimated memory of ``rows``: ``sys.getsizeof`` of each tuple and each value (shared objects
    such as ``None`` and small ints are counted every time, so this is an upper bound)."""
    return sum(map(sys.getsizeof, rows)) + sum(map(sys.getsizeof, itertools.chain.from_iterable(rows)))


def run_query(
    path: Path,
    sql: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_rows: int = MAX_ROWS,
    max_bytes: int = MAX_BYTES,
) -> list[tuple]:
    """All result rows of ``sql`` on a read-only connection to ``path``.

    Raises :class:`PaskError` for a missing or non-SQLite file, :class:`QueryFailed` when the
    query fails, runs longer than ``timeout_s`` seconds, returns more than ``max_rows`` rows or
    more than ``max_bytes`` estimated bytes (:func:`result_bytes`); fetching stops at the cap.
    """
    conn = connect_readonly(path)
    conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
    conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, min(max_bytes, conn.getlimit(sqlite3.SQLITE_LIMIT_LENGTH)))
    conn.set_authorizer(_authorize)
    deadline = time.monotonic() + timeout_s
    conn.set_progress_handler(lambda: int(time.monotonic() > deadline), _PROGRESS_STEPS)
    try:
        cursor = conn.execute(sql)
        width = len(cursor.description or ()) or 1
        chunk = max(1, min(_FETCH_ROWS, _FETCH_CELLS // width))
        rows: list[tuple] = []
        size = 0
        while batch := cursor.fetchmany(min(chunk, max_rows + 1 - len(rows))):
            rows.extend(batch)
            size += result_bytes(batch)
            if len(rows) > max_rows:
                raise QueryFailed(f"result over {max_rows} rows", "cap")
            if size > max_bytes:
                raise QueryFailed(f"result over {_mib(max_bytes)} (estimated)", "cap")
        return rows
    except MemoryError as e:  # SQLite's SQLITE_NOMEM or Python's own
        if time.monotonic() > deadline:
            raise QueryFailed(f"timeout after {timeout_s:g} s", "timeout") from None
        raise QueryFailed("out of memory", "cap") from e
    except (sqlite3.Error, ValueError, OverflowError) as e:
        if time.monotonic() > deadline:
            raise QueryFailed(f"timeout after {timeout_s:g} s", "timeout") from e
        if "too big" in str(e):  # a text or blob value over SQLITE_LIMIT_LENGTH
            raise QueryFailed(f"result value over {_mib(max_bytes)}", "cap") from e
        raise QueryFailed(f"{type(e).__name__}: {e}") from e
    finally:
        conn.close()


def _mib(n: int) -> str:
    return f"{n / (1 << 20):g} MiB" if n >= 1 << 20 else f"{n} bytes"


def _authorize(action: int, *_: object) -> int:
    return sqlite3.SQLITE_OK if action in _ALLOWED_ACTIONS else sqlite3.SQLITE_DENY


def rows_match(pred_rows: list[tuple], gold_rows: list[tuple]) -> bool:
    """BIRD's comparison: equal sets of rows."""
    return set(pred_rows) == set(gold_rows)


def execution_match(
    path: Path,
    pred_sql: str,
    gold_sql: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_rows: int = MAX_ROWS,
    max_bytes: int = MAX_BYTES,
) -> ExecResult:
    """Score ``pred_sql`` against ``gold_sql`` on the SQLite file ``path``.

    A gold query that fails or times out raises :class:`PaskError`; one whose result goes over a
    cap gives ``ExecResult(False, "gold query result over ...: not compared", gold_empty=False)``.
    The gold query runs once; the result's ``gold_empty`` comes from that run.
    """
    gold_rows, not_compared = _gold_rows(path, gold_sql, timeout_s, max_rows, max_bytes)
    if not_compared is not None:
        return ExecResult(False, not_compared, gold_empty=False)
    gold_empty = not gold_rows
    try:
        pred_rows = run_query(path, pred_sql, timeout_s, max_rows, max_bytes)
    except QueryFailed as e:
        return ExecResult(False, str(e), gold_empty)
    return ExecResult(rows_match(pred_rows, gold_rows), None, gold_empty)


def _gold_rows(
    path: Path, gold_sql: str, timeout_s: float, max_rows: int, max_bytes: int
) -> tuple[list[tuple], str | None]:
    """The gold query's rows, or ``([], "gold query ...: not compared")`` when its result went over a
    cap; :class:`PaskError` when it fails or times out (the data, not the prediction, is wrong)."""
    try:
        return run_query(path, gold_sql, timeout_s, max_rows, max_bytes), None
    except QueryFailed as e:
        if e.kind == "cap":
            return [], f"gold query {e}: not compared"
        raise PaskError(f"gold query fails on {path}: {e}\n  {gold_sql}") from e


@lru_cache(maxsize=4096)
def gold_is_empty(
    path: Path,
    gold_sql: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_rows: int = MAX_ROWS,
    max_bytes: int = MAX_BYTES,
) -> bool:
    """Whether ``gold_sql`` returns no rows on ``path`` (one run per query and file: cached).

    For cases that have no prediction to compare (and for rows of cells made before ``gold_empty``
    was recorded); a result over a cap is non-empty, a failing gold query raises :class:`PaskError`
    as in :func:`execution_match`.
    """
    rows, not_compared = _gold_rows(path, gold_sql, timeout_s, max_rows, max_bytes)
    return not_compared is None and not rows


def execution_accuracy(
    pred_sql: str,
    gold_sql: str,
    db_id: str,
    data_dir: Path | str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> ExecResult:
    """Score ``pred_sql`` against ``gold_sql`` on database ``db_id`` of a text-to-SQL data directory."""
    return execution_match(db_path(db_id, data_dir), pred_sql, gold_sql, timeout_s)
