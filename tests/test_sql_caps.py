"""SQL execution caps: result rows and estimated bytes per query, fetching stops at the cap."""

from __future__ import annotations

import sqlite3
import time
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pask.errors import PaskError
from pask.tasks import sql as sql_task
from pask.tasks import sql_exec
from pask.tasks.base import Output
from pask.tasks.sql_exec import MAX_BYTES, MAX_ROWS, QueryFailed, execution_match, run_query
from pask.tasks.text_to_sql import Case

N = 12  # rows of table t: a k-way cross join has 12**k rows


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small database whose cross joins explode: t(a, b, c, d, e) with 12 rows."""
    path = tmp_path_factory.mktemp("caps") / "caps.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE t (a INTEGER, b TEXT, c REAL, d TEXT, e INTEGER)")
    conn.executemany(
        "INSERT INTO t VALUES (?, ?, ?, ?, ?)", [(i, f"name{i}" * 3, i / 2, "x" * 20, -i) for i in range(N)]
    )
    conn.commit()
    conn.close()
    return path


def cross_join(k: int, cols: str = "t1.a") -> str:
    return f"SELECT {cols} FROM " + ", ".join(f"t AS t{i}" for i in range(1, k + 1))


def test_caps_are_module_constants() -> None:
    assert MAX_ROWS == 100_000
    assert MAX_BYTES == 64 << 20


def test_too_many_rows_is_a_failed_execution(db: Path) -> None:
    result = execution_match(db, cross_join(5), "SELECT 1")  # 248,832 rows
    assert not result.correct
    assert result.error == f"result over {MAX_ROWS} rows"


def test_too_many_bytes_is_a_failed_execution(db: Path) -> None:
    result = execution_match(db, cross_join(3, "*"), "SELECT 1", max_bytes=1 << 20)  # 1,728 wide rows
    assert not result.correct
    assert result.error == "result over 1 MiB (estimated)"
    assert len(run_query(db, cross_join(3, "*"))) == N**3  # under the default caps


def test_eight_way_cross_join_cannot_allocate_gibs(db: Path) -> None:
    """The defect: an allowed 8-way cross join reached 2.4 GiB. Fetching stops at the byte cap."""
    tracemalloc.start()
    t0 = time.monotonic()
    try:
        result = execution_match(db, cross_join(8, "*"), "SELECT 1")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert not result.correct
    assert result.error == "result over 64 MiB (estimated)"
    assert peak < 96 << 20  # the estimate is an upper bound: the real rows stay under the cap
    assert time.monotonic() - t0 < sql_exec.DEFAULT_TIMEOUT_S


def test_long_value_is_capped(db: Path) -> None:
    result = execution_match(db, "SELECT zeroblob(70000000)", "SELECT 1")
    assert not result.correct and result.error == "result value over 64 MiB"


def test_gold_over_the_cap_is_recorded_not_raised(db: Path) -> None:
    result = execution_match(db, "SELECT 1", cross_join(5))
    assert not result.correct
    assert result.error == f"gold query result over {MAX_ROWS} rows: not compared"
    with pytest.raises(PaskError, match="gold query fails"):  # a gold query that does not run still stops
        execution_match(db, "SELECT 1", "SELECT nosuch FROM t")


def test_out_of_memory_is_a_failed_execution(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_memory(rows: list[tuple]) -> int:
        raise MemoryError

    monkeypatch.setattr(sql_exec, "result_bytes", no_memory)
    with pytest.raises(QueryFailed, match="out of memory") as e:
        run_query(db, "SELECT * FROM t")
    assert e.value.kind == "cap"
    assert execution_match(db, "SELECT a FROM t", "SELECT 1").error == "gold query out of memory: not compared"


def test_the_cap_is_the_case_rows_error(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``pask eval sql`` records the cap as the case's execution error."""
    monkeypatch.setattr(sql_task, "database", lambda db_id, data_dir=None: type("Db", (), {"path": db})())
    case = Case(id="dev-0000", db_id="caps", question="?", gold_sql="SELECT a FROM t", difficulty="easy")
    row = sql_task.SqlTask().check(case, Output(cross_join(5), "grammar"))
    assert row == {"correct": False, "error": f"result over {MAX_ROWS} rows", "gold_empty": False}
    rows = [{**row, "difficulty": "easy", "stop_reason": "grammar", "budget": None}]
    assert sql_task.summarize(rows)["overall"]["exec_errors"] == 1


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(k=st.integers(1, 4), max_rows=st.integers(1, 2000))
def test_row_cap_boundary(db: Path, k: int, max_rows: int) -> None:
    """All rows come back iff there are at most ``max_rows``; one more is a failed execution."""
    n = N**k
    try:
        rows = run_query(db, cross_join(k), max_rows=max_rows)
    except QueryFailed as e:
        assert n > max_rows and e.kind == "cap" and str(e) == f"result over {max_rows} rows"
    else:
        assert n <= max_rows and len(rows) == n
