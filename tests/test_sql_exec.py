"""Execution accuracy (BIRD's rule) on read-only SQLite connections."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from pask.errors import PaskError
from pask.tasks.sql_exec import execution_accuracy, execution_match, run_query
from pask.tasks.text_to_sql import db_path, load_cases

INFINITE = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"


@pytest.fixture
def db(tmp_path: Path) -> Path:
    """A private copy of concert_singer, so a broken guard could not damage the data."""
    dest = tmp_path / "concert_singer.sqlite"
    shutil.copy(db_path("concert_singer"), dest)
    return dest


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize(
    ("pred", "gold"),
    [
        ("SELECT name FROM singer ORDER BY name DESC", "SELECT name FROM singer"),  # row order
        ("SELECT country FROM singer", "SELECT DISTINCT country FROM singer"),  # duplicates
        ("SELECT T1.Name FROM singer AS T1 WHERE T1.Age > 30", "select name from singer where age  >  30"),
        ("SELECT count(*) FROM singer", "SELECT count(Singer_ID) FROM singer"),
    ],
)
def test_equivalent_queries_score_1(db: Path, pred: str, gold: str) -> None:
    assert execution_match(db, pred, gold).correct


@pytest.mark.parametrize(
    ("pred", "gold"),
    [
        ("SELECT country, name FROM singer", "SELECT name, country FROM singer"),  # column order
        ("SELECT name FROM singer WHERE age > 30", "SELECT name FROM singer"),  # wrong rows
        ("SELECT name, name FROM singer", "SELECT name FROM singer"),  # extra column
    ],
)
def test_different_results_score_0(db: Path, pred: str, gold: str) -> None:
    result = execution_match(db, pred, gold)
    assert not result.correct and result.error is None


def test_errors_and_timeouts_score_0(db: Path) -> None:
    error = execution_match(db, "SELECT nosuch FROM singer", "SELECT name FROM singer")
    assert not error.correct and "no such column" in error.error
    timeout = execution_match(db, INFINITE, "SELECT 1", timeout_s=0.2)
    assert not timeout.correct and timeout.error.startswith("timeout")
    too_many = execution_match(db, "SELECT * FROM singer", "SELECT 1", max_rows=2)
    assert not too_many.correct and "rows" in too_many.error


@pytest.mark.parametrize(
    "sql",
    [
        "INSERT INTO singer (Singer_ID, Name) VALUES (99, 'x')",
        "UPDATE singer SET Name = 'x'",
        "DELETE FROM singer",
        "DROP TABLE singer",
        "CREATE TABLE t (x INT)",
        "PRAGMA query_only = OFF",
        "SELECT 1; DROP TABLE singer",
        "ATTACH DATABASE 'attached.sqlite' AS other",
    ],
)
def test_writes_are_impossible(db: Path, sql: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(db.parent)
    before = _sha256(db)
    result = execution_match(db, sql, "SELECT 1")
    assert not result.correct and result.error
    assert _sha256(db) == before
    assert sorted(p.name for p in db.parent.iterdir()) == [db.name]
    assert len(run_query(db, "SELECT * FROM singer")) == 6


def test_bad_inputs_raise(tmp_path: Path) -> None:
    with pytest.raises(PaskError, match="not found"):
        execution_match(tmp_path / "missing.sqlite", "SELECT 1", "SELECT 1")
    junk = tmp_path / "junk.sqlite"
    junk.write_text("this is not a database, just long enough text")
    with pytest.raises(PaskError, match="not a SQLite"):
        execution_match(junk, "SELECT 1", "SELECT 1")
    with pytest.raises(PaskError, match="unknown db_id"):
        execution_accuracy("SELECT 1", "SELECT 1", "no_such_db")


def test_failing_gold_raises(db: Path) -> None:
    with pytest.raises(PaskError, match="gold query"):
        execution_match(db, "SELECT 1", "SELECT nosuch FROM singer")


def test_every_gold_query_matches_itself() -> None:
    for case in load_cases():
        result = execution_accuracy(case.gold_sql, case.gold_sql, case.db_id)
        assert result.correct, (case.id, result)
