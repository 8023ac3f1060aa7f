"""Text-to-SQL data: cases, splits, difficulty buckets, schema and DDL prompt."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest

from pask.errors import PaskError
from pask.structure.sql_schema import quote_identifier
from pask.tasks.spider_hardness import LEVELS, spider_hardness
from pask.tasks.sql_prompt import SPAN_KINDS, build_messages, schema_ddl
from pask.tasks.text_to_sql import (
    DEFAULT_DATA_DIR,
    SPLIT_FRACTIONS,
    SPLITS,
    db_path,
    load_cases,
    load_schema,
    split_cases,
)

PINNED_SPLITS = {
    "calibration": {"museum_visit", "orchestra", "student_transcripts_tracking"},
    "dev": {"course_teach", "network_1", "real_estate_properties", "singer", "voter_1"},
    "test": {
        "battle_death",
        "concert_singer",
        "cre_Doc_Template_Mgt",
        "employee_hire_evaluation",
        "flight_2",
        "pets_1",
        "poker_player",
        "tvshow",
    },
}


@pytest.fixture(scope="module")
def cases():
    return load_cases()


def test_cases_load(cases) -> None:
    assert len(cases) == 740
    assert len({c.id for c in cases}) == 740
    assert cases[0].gold_sql == "SELECT count(*) FROM singer" and cases[0].db_id == "concert_singer"
    assert {c.db_id for c in cases if not c.original_db} == {"wta_1"}
    assert sum(c.original_db for c in cases) == 678


def test_splits_database_disjoint_deterministic_complete(cases) -> None:
    splits = split_cases(cases)
    assert tuple(splits) == SPLITS
    dbs = {name: {c.db_id for c in part} for name, part in splits.items()}
    assert dbs == PINNED_SPLITS  # the documented fixed assignment
    ids = [c.id for part in splits.values() for c in part]
    assert sorted(ids) == sorted(c.id for c in cases if c.original_db)  # every scored case exactly once
    assert split_cases(load_cases()) == splits
    for name, fraction in zip(SPLITS, SPLIT_FRACTIONS, strict=True):
        assert abs(len(splits[name]) / len(ids) - fraction) < 0.02
    other = {name: {c.db_id for c in part} for name, part in split_cases(cases, seed=1).items()}
    assert other != dbs and all(a.isdisjoint(b) for a in other.values() for b in other.values() if a is not b)


def test_difficulty_buckets(cases) -> None:
    counts = Counter(c.difficulty for c in cases)
    assert counts == {"easy": 196, "medium": 332, "hard": 128, "extra": 84}
    for part in split_cases(cases).values():
        assert set(Counter(c.difficulty for c in part)) == set(LEVELS)


def _tree(**over) -> dict:
    sql = {
        "select": [False, [[3, [0, [0, 0, False], None]]]],
        "from": {"table_units": [["table_unit", 0]], "conds": []},
        "where": [],
        "groupBy": [],
        "having": [],
        "orderBy": [],
        "limit": None,
        "intersect": None,
        "union": None,
        "except": None,
    }
    sql.update(over)
    return sql


def test_hardness_rule() -> None:
    cond = [False, 2, [0, [0, 1, False], None], 1.0, None]
    assert spider_hardness(_tree()) == "easy"  # SELECT count(*) FROM t
    assert spider_hardness(_tree(where=[cond])) == "easy"
    assert spider_hardness(_tree(where=[cond, "and", cond])) == "medium"  # two conditions
    assert spider_hardness(_tree(where=[[False, 8, [0, [0, 1, False], None], _tree(), None]])) == "hard"
    assert spider_hardness(_tree(where=[cond], union=_tree(where=[cond]))) == "hard"
    ordered = _tree(where=[cond], limit=1, orderBy=["asc", [[0, [0, 1, False], None]]], union=_tree())
    assert spider_hardness(ordered) == "extra"


def test_schema_reads_keys() -> None:
    table = {t.name: t for t in load_schema("course_teach").tables}["course_arrange"]
    assert table.primary_key == ("Course_ID", "Teacher_ID", "Grade")
    assert {(fk.columns, fk.ref_table, fk.ref_columns) for fk in table.foreign_keys} == {
        (("Course_ID",), "course", ("Course_ID",)),
        (("Teacher_ID",), "teacher", ("Teacher_ID",)),
    }


@pytest.mark.parametrize("db_id", sorted(p.name for p in (DEFAULT_DATA_DIR / "database").iterdir()))
def test_ddl_lists_every_table_and_column(db_id: str) -> None:
    schema = load_schema(db_id)
    text, spans = schema_ddl(schema)
    assert [s.start for s in spans[1:]] == [s.end for s in spans[:-1]] and spans[0].start == 0
    assert spans[-1].end == len(text)  # spans tile the text
    assert {s.kind for s in spans} <= set(SPAN_KINDS)
    by_kind = {k: {s.name: text[s.start : s.end] for s in spans if s.kind == k} for k in SPAN_KINDS}
    for t in schema.tables:
        assert by_kind["table"][t.name] == quote_identifier(t.name)
        assert f"CREATE TABLE {quote_identifier(t.name)} (" in text
        for c in t.columns:
            assert by_kind["column"][f"{t.name}.{c.name}"] == quote_identifier(c.name)
            assert by_kind["type"][f"{t.name}.{c.name}"] == c.type
        if t.primary_key:
            assert by_kind["constraint"][f"{t.name}.pk"].startswith("PRIMARY KEY (")
        for fk in t.foreign_keys:
            clause = by_kind["constraint"][f"{t.name}.fk.{'+'.join(fk.columns)}"]
            assert clause.startswith("FOREIGN KEY (") and f"REFERENCES {quote_identifier(fk.ref_table)}" in clause


def test_prompt_messages_and_sample_rows(cases) -> None:
    schema = load_schema("concert_singer")
    plain, _ = schema_ddl(schema)
    messages = build_messages(cases[0], schema)
    assert [m["role"] for m in messages] == ["system", "user"]
    assert plain in messages[1]["content"] and cases[0].question in messages[1]["content"]
    with_rows, spans = schema_ddl(schema, sample_rows=2)
    samples = [s for s in spans if s.kind == "sample"]
    assert {s.name for s in samples} == {t.name for t in schema.tables}
    assert len(samples) == 3 * len(schema.tables)  # header + 2 rows per table
    assert "Joe Sharp" in with_rows
    assert with_rows in build_messages(cases[0], schema, sample_rows=2)[1]["content"]


def test_other_data_dir(tmp_path: Path) -> None:
    src = DEFAULT_DATA_DIR
    entry = json.loads((src / "dev.json").read_text())[0]
    tables = [t for t in json.loads((src / "tables.json").read_text()) if t["db_id"] == "concert_singer"]
    (tmp_path / "dev.json").write_text(json.dumps([entry, entry]))
    (tmp_path / "tables.json").write_text(json.dumps(tables))
    (tmp_path / "database" / "concert_singer").mkdir(parents=True)
    shutil.copy(db_path("concert_singer"), tmp_path / "database" / "concert_singer" / "concert_singer.sqlite")
    got = load_cases(tmp_path)
    assert [c.id for c in got] == ["dev-0000", "dev-0001"] and all(c.original_db for c in got)
    assert load_schema("concert_singer", tmp_path).path.parent.parent.parent == tmp_path
    with pytest.raises(PaskError, match="unknown db_id"):
        db_path("pets_1", tmp_path)
    with pytest.raises(PaskError, match="missing"):
        load_cases(tmp_path / "nowhere")
