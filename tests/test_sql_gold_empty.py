"""EX with and without the cases whose gold query returns no rows (``gold_empty``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pask.errors import PaskError
from pask.evaluation.case_rows import read_done
from pask.tasks import Output, get_task
from pask.tasks.sql import database, select_cases, summarize, table_markdown, with_gold_empty
from pask.tasks.sql_exec import execution_match, gold_is_empty
from pask.tasks.text_to_sql import db_path

SQL = get_task("sql")
EMPTY = "SELECT name FROM singer WHERE age > 1000"
NONEMPTY = "SELECT name FROM singer"


@pytest.fixture
def db(tmp_path: Path) -> Path:
    dest = tmp_path / "concert_singer.sqlite"
    shutil.copy(db_path("concert_singer"), dest)
    return dest


@pytest.fixture(scope="module")
def test_cases():
    return select_cases("test")


def _is_empty(case) -> bool:
    return gold_is_empty(database(case.db_id).path, case.gold_sql)


def test_execution_match_records_the_gold_result(db: Path) -> None:
    right = execution_match(db, "SELECT name FROM singer WHERE age > 999", EMPTY)
    assert right.correct and right.gold_empty is True  # an empty prediction on an empty gold: a free point
    assert execution_match(db, NONEMPTY, NONEMPTY).gold_empty is False
    failed = execution_match(db, "SELECT nosuch FROM singer", EMPTY)
    assert not failed.correct and failed.gold_empty is True  # the gold query ran before the prediction failed
    assert gold_is_empty(db, EMPTY) and not gold_is_empty(db, NONEMPTY)
    with pytest.raises(PaskError, match="gold query fails"):
        gold_is_empty(db, "SELECT nosuch FROM singer")


def test_gold_over_a_cap_counts_as_nonempty(db: Path) -> None:
    res = execution_match(db, "SELECT 1", NONEMPTY, max_rows=2)
    assert res.error.endswith("not compared") and res.gold_empty is False
    assert gold_is_empty(db, NONEMPTY, max_rows=2) is False


def test_test_split_has_36_empty_gold_cases(test_cases) -> None:
    assert len(test_cases) == 407
    assert sum(map(_is_empty, test_cases)) == 36


def test_check_records_gold_empty_on_every_path(test_cases) -> None:
    empty = next(c for c in test_cases if _is_empty(c))
    full = next(c for c in test_cases if not _is_empty(c))
    for case, expected in ((empty, True), (full, False)):
        assert SQL.check(case, Output(case.gold_sql, "grammar")) == {
            "correct": True,
            "error": None,
            "gold_empty": expected,
        }
        assert SQL.check(case, Output("  ", "length"))["gold_empty"] is expected
        err = SQL.check(case, Output("", "schema_error", error="schema_error: x"))
        assert err == {"correct": False, "error": "schema_error: x", "gold_empty": expected}


def _row(difficulty: str, correct: bool, gold_empty: bool | None = None) -> dict:
    row = {"difficulty": difficulty, "correct": correct, "error": None, "stop_reason": "eos", "budget": None}
    if gold_empty is not None:
        row["gold_empty"] = gold_empty
    return row


ROWS = [
    _row("easy", True, True),  # an empty gold result: left out of ex_nonempty_gold
    _row("easy", True, False),
    _row("medium", False, False),
    _row("hard", True, False),
    _row("extra", False, True),
]


def test_summarize_with_gold_empty() -> None:
    o = summarize(ROWS)["overall"]
    assert o["ex"] == 60.0 and o["correct"] == 3 and o["n"] == 5
    assert o["gold_empty"] == 2 and o["ex_nonempty_gold"] == 66.67  # 2 of the 3 non-empty
    md = table_markdown(summarize(ROWS), {"model": "q", "policy": "full"})
    assert "| Overall EX | EX (gold ≠ ∅) |" in md
    assert "| q | full | 1.000 | 100.00 | 0.00 | 100.00 | 0.00 | 60.00 | 66.67 |" in md
    assert "|  |  | n | 2 | 1 | 1 | 1 | 5 | 3 |" in md
    assert "no rows in 2/5 cases" in md


def test_all_gold_empty_gives_no_ex() -> None:
    o = summarize([_row("easy", True, True)])["overall"]
    assert o["gold_empty"] == 1 and o["ex_nonempty_gold"] is None
    assert "| 100.00 | – |" in table_markdown(summarize([_row("easy", True, True)]))


@pytest.mark.parametrize(
    "rows", [[{**r, "gold_empty": None} for r in ROWS], [_row(r["difficulty"], r["correct"]) for r in ROWS]]
)
def test_old_rows_without_gold_empty(rows: list[dict]) -> None:
    s = summarize(rows)
    assert s["overall"]["ex"] == 60.0
    assert s["overall"]["gold_empty"] is None and s["overall"]["ex_nonempty_gold"] is None
    md = table_markdown(s, {"model": "q", "policy": "full"})
    assert "| 60.00 | – |" in md and "| 5 | – |" in md and "no rows in" not in md


def test_a_cell_mixing_old_and_new_rows_is_not_split() -> None:
    rows = [*ROWS[:4], _row("extra", False)]
    assert summarize(rows)["overall"]["ex_nonempty_gold"] is None


def test_old_summary_json_renders() -> None:
    s = summarize(ROWS)
    for k in ("gold_empty", "ex_nonempty_gold"):
        del s["overall"][k]  # a summary.json written before the fields existed
    assert "| 60.00 | – |" in table_markdown(s)


def test_with_gold_empty_fills_old_rows(test_cases, tmp_path: Path) -> None:
    cases = [next(c for c in test_cases if _is_empty(c)), next(c for c in test_cases if not _is_empty(c))]
    old = [{"id": c.id, "db_id": c.db_id, **_row(c.difficulty, True)} for c in cases]
    filled = with_gold_empty(old)
    assert [r["gold_empty"] for r in filled] == [True, False] and "gold_empty" not in old[0]  # a copy
    assert summarize(filled)["overall"]["ex_nonempty_gold"] == 100.0
    kept = [{**filled[0], "gold_empty": False}]  # a recorded value is not recomputed
    assert with_gold_empty(kept)[0]["gold_empty"] is False
    (tmp_path / "cases.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old) + '{"id": "torn')
    done = list(read_done(tmp_path / "cases.jsonl").values())  # a committed cell's rows
    assert [r["gold_empty"] for r in with_gold_empty(done)] == [True, False]
    with pytest.raises(PaskError, match="not a question"):
        with_gold_empty([{**old[0], "id": "dev-99999"}])
    with pytest.raises(PaskError, match="not a question"):
        with_gold_empty([{**old[0], "db_id": "not_its_db"}])
