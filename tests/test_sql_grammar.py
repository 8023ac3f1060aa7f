"""The per-database SQL grammar: gold coverage on Spider dev, schema binding, clean termination."""

from __future__ import annotations

import llguidance
import llguidance.hf
import pytest

from pask.structure.sql_grammar import SqlGrammarChecker, sql_grammar
from pask.tasks.text_to_sql import load_cases, load_schema

MIN_COVERAGE = 0.98


@pytest.fixture(scope="module")
def tokenizers(qwen_tokenizer) -> tuple[object, llguidance.LLTokenizer]:
    """The Qwen tokenizer (shared conftest fixture) and its llguidance view."""
    return qwen_tokenizer, llguidance.hf.from_tokenizer(qwen_tokenizer)


@pytest.fixture(scope="module")
def checker(tokenizers) -> SqlGrammarChecker:
    return SqlGrammarChecker(load_schema("concert_singer"), *tokenizers)


def test_gold_coverage(tokenizers) -> None:
    checkers: dict[str, SqlGrammarChecker] = {}
    rejected = []
    cases = load_cases()
    assert len(cases) == 740
    for case in cases:
        if case.db_id not in checkers:
            checkers[case.db_id] = SqlGrammarChecker(load_schema(case.db_id), *tokenizers)
        check = checkers[case.db_id].check(case.gold_sql)
        if not check.accepted:
            rejected.append(f"{case.id} {case.db_id} @{check.offset} {check.detail}: {case.gold_sql}")
    coverage = 1 - len(rejected) / len(cases)
    assert coverage >= MIN_COVERAGE, f"coverage {coverage:.3f}; rejected:\n" + "\n".join(rejected)


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT name FROM singers",  # unknown table extending a known one
        "SELECT name FROM nosuch",
        "SELECT count(*) FROM singer AS T1 JOIN nosuch AS T2 ON T1.Singer_ID = T2.id",
        "SELECT nosuch FROM singer",  # unknown column
        "SELECT name_x FROM singer",
        "SELECT T1.nosuch FROM singer AS T1",
        "SELECT name FROM singer WHERE nosuch = 1",
        "SELECT name FROM singer s",  # aliases need AS
        "DROP TABLE singer",
        "SELECT name FROM singer; SELECT 1",
        "SELECT name FROM singer WHERE",
        "SELECT Name FROM ſinger",  # the long s: (?i) folds it to s, SQLite does not
    ],
)
def test_rejects(checker: SqlGrammarChecker, sql: str) -> None:
    assert not checker.check(sql).accepted


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT name FROM singer AS s WHERE s.age > 30 ORDER BY s.name",
        "select DISTINCT T2.Name from concert as T1 join stadium as T2 on T1.Stadium_ID = T2.Stadium_ID",
        "SELECT NAME, nAmE FROM SINGER",
        'SELECT "Name", `Age`, [Country] FROM "singer"',
        "SELECT count(*) AS n, country FROM singer GROUP BY country HAVING count(*) > 1 ORDER BY n DESC LIMIT 1",
        "SELECT name FROM singer WHERE age IS NOT NULL AND NOT country LIKE 'F%' AND age NOT BETWEEN 1 AND 2",
        "SELECT (SELECT count(*) FROM singer) - (SELECT count(*) FROM concert)",
        "SELECT CASE WHEN age > 30 THEN 'old' ELSE 'young' END, CAST(age AS REAL) / 2 FROM singer",
        "SELECT name FROM (SELECT name FROM singer) AS sub UNION ALL SELECT name FROM stadium LIMIT 3 OFFSET 1;",
        "SELECT name\nFROM singer\nWHERE country = 'it''s' OR age IN (1, -2.5e1)\n",
    ],
)
def test_accepts(checker: SqlGrammarChecker, sql: str) -> None:
    assert checker.check(sql).accepted, checker.check(sql)


def test_quoted_only_identifiers(tokenizers) -> None:
    tv = SqlGrammarChecker(load_schema("tvshow"), *tokenizers)
    assert tv.check('SELECT "18_49_Rating_Share" FROM TV_series').accepted
    assert not tv.check("SELECT 18_49_Rating_Share FROM TV_series").accepted


def test_terminates_cleanly(tokenizers) -> None:
    tok, ll_tok = tokenizers
    grammar = llguidance.LLMatcher.grammar_from_lark(sql_grammar(load_schema("concert_singer")))
    m = llguidance.LLMatcher(ll_tok, grammar, log_level=0)
    assert m.consume_tokens(tok.encode("SELECT count(*) FROM singer", add_special_tokens=False))
    assert m.is_accepting() and not m.is_stopped()  # EOS allowed, query may go on
    assert m.consume_tokens(tok.encode(";", add_special_tokens=False))
    assert m.is_stopped()  # nothing but EOS after ';'


def test_order_by_alias_switch(tokenizers, checker: SqlGrammarChecker) -> None:
    strict = SqlGrammarChecker(load_schema("concert_singer"), *tokenizers, order_by_aliases=False)
    sql = "SELECT count(*) AS n, country FROM singer GROUP BY country ORDER BY n"
    assert checker.check(sql).accepted
    assert not strict.check(sql).accepted
    assert strict.check("SELECT name FROM singer ORDER BY age DESC").accepted
