"""``--data-dir`` on a Spider-layout directory pask has never seen: two small hand-made databases.

Splits, schema rendering, the grammar and the scope check, EX, and ``pask eval sql`` end to end on
them (issue 28). The questions carry no parsed query (``sql``), as a user's own file would not:
their difficulty is ``unrated``.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pask.cli import app
from pask.errors import PaskError
from pask.structure.sql_scope import scope_errors
from pask.tasks.registry import get_task
from pask.tasks.sql import select_cases
from pask.tasks.sql_exec import execution_match
from pask.tasks.sql_prompt import schema_ddl
from pask.tasks.text_to_sql import UNRATED, load_cases, load_schema, split_cases

DATABASES = {
    "library": """
        CREATE TABLE author (author_id INTEGER PRIMARY KEY, name TEXT, country TEXT);
        CREATE TABLE book (book_id INTEGER PRIMARY KEY, title TEXT, year INTEGER,
                           author_id INTEGER REFERENCES author(author_id));
        CREATE TABLE loan (loan_id INTEGER PRIMARY KEY, book_id INTEGER REFERENCES book(book_id),
                           member TEXT, "due date" TEXT);
        INSERT INTO author VALUES (1, 'Sigrid Undset', 'Norway'), (2, 'Italo Calvino', 'Italy');
        INSERT INTO book VALUES (1, 'Kristin Lavransdatter', 1920, 1), (2, 'Invisible Cities', 1972, 2),
                                (3, 'Jenny', 1911, 1);
        INSERT INTO loan VALUES (1, 1, 'ana', '2026-01-10'), (2, 2, 'bo', '2026-02-01'), (3, 3, 'ana', '2026-03-05');
    """,
    "garden": """
        CREATE TABLE plant (plant_id INTEGER PRIMARY KEY, species TEXT, bed_id INTEGER REFERENCES bed(bed_id));
        CREATE TABLE bed (bed_id INTEGER PRIMARY KEY, sunny INTEGER);
        INSERT INTO bed VALUES (1, 1), (2, 0);
        INSERT INTO plant VALUES (1, 'tomato', 1), (2, 'fern', 2), (3, 'basil', 1);
    """,
}
QUESTIONS = [
    ("library", "How many books are there?", "SELECT count(*) FROM book"),
    (
        "library",
        "List the titles of the books by authors from Norway.",
        "SELECT T2.title FROM author AS T1 JOIN book AS T2 ON T1.author_id = T2.author_id WHERE T1.country = 'Norway'",
    ),
    (
        "library",
        "Which members borrowed a book written before 1950?",
        "SELECT DISTINCT T1.member FROM loan AS T1 JOIN book AS T2 ON T1.book_id = T2.book_id WHERE T2.year < 1950",
    ),
    ("library", "When is each loan due?", 'SELECT loan_id, "due date" FROM loan'),
    (
        "garden",
        "Which species grow in sunny beds?",
        "SELECT species FROM plant JOIN bed USING (bed_id) WHERE sunny = 1",
    ),
    ("garden", "How many beds are there?", "SELECT count(*) FROM bed"),
]


@pytest.fixture
def own(tmp_path: Path) -> Path:
    """A Spider-layout directory: dev.json, tables.json, database/<db_id>/<db_id>.sqlite."""
    d = tmp_path / "own"
    for db, script in DATABASES.items():
        (d / "database" / db).mkdir(parents=True)
        con = sqlite3.connect(d / "database" / db / f"{db}.sqlite")
        con.executescript(script)
        con.commit()
        con.close()
    (d / "tables.json").write_text(json.dumps([{"db_id": db} for db in DATABASES]))
    (d / "dev.json").write_text(json.dumps([{"db_id": db, "question": q, "query": s} for db, q, s in QUESTIONS]))
    return d


def test_cases_and_splits(own):
    cases = load_cases(own)
    assert [c.gold_sql for c in cases] == [s for _, _, s in QUESTIONS]
    assert {c.difficulty for c in cases} == {UNRATED} and all(c.original_db for c in cases)
    splits = split_cases(cases)
    for db in DATABASES:  # database-disjoint: each database's questions in one split
        assert sum(any(c.db_id == db for c in s) for s in splits.values()) == 1
    assert sorted(c.id for s in splits.values() for c in s) == [c.id for c in cases]
    assert [c.id for c in select_cases("all", data_dir=own)] == [c.id for c in cases]
    assert len(select_cases("all", limit=2, data_dir=own)) == 2
    with pytest.raises(PaskError, match="would leak the test split"):
        get_task("sql").check_fit("all", {})


def test_schema_rendering_foreign_keys_and_quoted_names(own):
    schema = load_schema("library", own)
    assert [t.name for t in schema.tables] == ["author", "book", "loan"]
    book = next(t for t in schema.tables if t.name == "book")
    assert [(fk.columns, fk.ref_table) for fk in book.foreign_keys] == [(("author_id",), "author")]
    ddl, _ = schema_ddl(schema)
    assert "CREATE TABLE book" in ddl and '"due date"' in ddl


def test_gold_queries_pass_the_grammar_and_the_scope_check(own, smol_tokenizer):
    from pask.runtime.tokens import eos_ids
    from pask.structure.constraint import allocate_mask, ll_tokenizer
    from pask.structure.sql_grammar import sql_grammar
    from pask.structure.sql_scope import ScopedConstraint

    eos = eos_ids(smol_tokenizer)
    ll = ll_tokenizer(smol_tokenizer, eos)
    for db, _, sql in QUESTIONS:
        schema = load_schema(db, own)
        assert scope_errors(sql, schema) == []
        c = ScopedConstraint(ll, sql_grammar(schema), schema, eos)
        bm = allocate_mask(1, c.vocab_size)
        for t in [*smol_tokenizer.encode(sql, add_special_tokens=False), eos[0]]:
            c.mask(bm, 0)
            assert (int(bm[0, t >> 5]) >> (t & 31)) & 1, f"{c.text!r} + {smol_tokenizer.decode([t])!r}"
            if t != eos[0]:
                c.consume(t)
    library = load_schema("library", own)
    assert [str(e) for e in scope_errors("SELECT title FROM author", library)] == ["no such column: title"]


def test_execution_accuracy(own):
    path = own / "database" / "library" / "library.sqlite"
    gold = QUESTIONS[1][2]
    assert execution_match(path, "SELECT title FROM book WHERE author_id = 1", gold).correct
    wrong = execution_match(path, "SELECT title FROM book", gold)
    assert not wrong.correct and wrong.error is None
    bad = execution_match(path, "SELECT title FROM author", gold)
    assert not bad.correct and "no such column" in bad.error


def test_eval_sql_on_own_data_end_to_end(own, tmp_path):
    out = tmp_path / "run"
    args = ["eval", "sql", "--model", "smollm2-135m", "--dtype", "fp32", "--data-dir", str(own), "--split", "all"]
    args += ["--sql-scope", "on", "--max-new-tokens", "48", "--out", str(out)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["overall"]["n"] == len(QUESTIONS)
    assert summary["difficulties"][UNRATED]["n"] == len(QUESTIONS)
    rows = [json.loads(line) for line in (out / "cases.jsonl").read_text().splitlines()]
    assert {r["db_id"] for r in rows} == set(DATABASES)
    for r in rows:  # the scope check held: no finished query names a column its FROM clause lacks
        if r["stop_reason"] == "eos":
            assert scope_errors(r["output"], load_schema(r["db_id"], own)) == [], r["output"]
    assert "Unrated EX" in (out / "summary.md").read_text()


def test_calibration_may_join_splits_but_never_the_test_split():
    from pask.calibration.tasks import get_task as calibration_task

    load = calibration_task("sql").load
    cal, dev = load("calibration", None, 3)[0], load("dev", None, 3)[0]
    both, cats = load("calibration+dev", None, 3)
    assert [c.id for c in both] == [c.id for c in cal + dev] and cats == [] and len(both) == 6
    for bad, msg in [
        ("calibration+test", "would leak the test split"),
        ("dev+dev", "distinct split names"),
        ("calibration+", "distinct split names"),
    ]:
        with pytest.raises(PaskError, match=msg):
            load(bad, None, None)
