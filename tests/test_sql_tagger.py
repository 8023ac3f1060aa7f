"""SQL tagger: hand-written queries checked exactly, Spider dev gold queries checked by property."""

from __future__ import annotations

import codecs
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlglot.dialects.sqlite import SQLite
from sqlglot.tokens import TokenType

from pask.structure.constraint import ll_tokenizer
from pask.structure.sql_tagger import SqlTagger
from pask.structure.tags import SQL_FALLBACK, Next, SqlRole, State, Tag, TagClass, sql_tags

SPIDER = Path("/work/shared/data/spider-dev")
if not (SPIDER / "dev.json").exists():
    SPIDER = Path(__file__).resolve().parents[1] / "data" / "spider-dev"

ALL_TAGS = frozenset(sql_tags())
ROLE = {"P": SqlRole.PROJECTION, "R": SqlRole.RELATION, "W": SqlRole.PREDICATE, "O": SqlRole.OUTSIDE_SCHEMA}
KIND = {
    "kw": (TagClass.PURE_SCAFFOLD, State.BOUNDARY),
    "op": (TagClass.PURE_SCAFFOLD, State.STABLE),
    "id": (TagClass.SCHEMA_BEARING, State.CRITICAL),
    "lit": (TagClass.FREE_GENERATION, State.STABLE),
}
SCHEMA = {
    "singer": ["Singer_ID", "Name", "Country", "Age", "Is_male"],
    "concert": ["concert_ID", "concert_Name", "Stadium_ID", "Year"],
    "singer_in_concert": ["concert_ID", "Singer_ID"],
    "stadium": ["Stadium_ID", "Location", "Name", "Capacity"],
}

JOIN_QUERY = [
    ("SELECT", "P", "kw"),
    (" T1.", "P", "id"),
    ("Name", "P", "id"),
    (",", "P", "kw"),
    (" count(", "P", "kw"),
    ("*", "P", "op"),
    (")", "P", "kw"),
    (" FROM", "R", "kw"),
    (" singer", "R", "id"),
    (" AS", "R", "op"),
    (" T1", "R", "id"),
    (" JOIN", "R", "kw"),
    (" singer_in_concert", "R", "id"),
    (" AS", "R", "op"),
    (" T2", "R", "id"),
    (" ON", "W", "kw"),
    (" T1.", "W", "id"),
    ("Singer_ID", "W", "id"),
    (" =", "W", "op"),
    (" T2", "W", "id"),
    (".", "W", "op"),
    ("Singer_ID", "W", "id"),
    (" WHERE", "W", "kw"),
    (" T1.", "W", "id"),
    ("Age", "W", "id"),
    (" >", "W", "op"),
    ("=", "W", "op"),
    (" 30", "W", "lit"),
    (" GROUP", "W", "kw"),
    (" BY", "O", "kw"),
    (" T1.", "O", "id"),
    ("Name", "O", "id"),
    (" ORDER BY", "O", "kw"),
    (" count(", "O", "kw"),
    ("*", "O", "op"),
    (")", "O", "kw"),
    (" DESC", "O", "op"),
    (" LIMIT", "O", "kw"),
    (" 3", "O", "lit"),
]
SUBQUERY_QUERY = [
    ("SELECT", "P", "kw"),
    (" Name", "P", "id"),
    (" FROM", "R", "kw"),
    (" stadium", "R", "id"),
    (" WHERE", "W", "kw"),
    (" Capacity", "W", "id"),
    (" >", "W", "op"),
    (" (", "W", "kw"),
    ("SELECT", "P", "kw"),
    (" avg(", "P", "kw"),
    ("Capacity", "P", "id"),
    (")", "P", "kw"),
    (" FROM", "R", "kw"),
    (" stadium", "R", "id"),
    (")", "W", "kw"),
    (" EXCEPT", "O", "kw"),
    (" SELECT", "P", "kw"),
    (" Name", "P", "id"),
    (" FROM", "R", "kw"),
    (" stadium", "R", "id"),
    (" WHERE", "W", "kw"),
    (" Location", "W", "id"),
    (" =", "W", "op"),
    (" 'Raith", "W", "lit"),
    (" Rovers'", "W", "lit"),
    (" AND", "W", "op"),
    (" Name", "W", "id"),
    (" LIKE", "W", "op"),
    (' "%x%"', "W", "lit"),
    (";", "W", "kw"),
]
NESTED_QUERY = [
    ("SELECT", "P", "kw"),
    (" count(", "P", "kw"),
    ("DISTINCT", "P", "op"),
    (" T1.", "P", "id"),
    ("Country", "P", "id"),
    (")", "P", "kw"),
    (" FROM", "R", "kw"),
    (" singer", "R", "id"),
    (" T1", "R", "id"),  # alias without AS
    (" WHERE", "W", "kw"),
    (" T1.", "W", "id"),
    ("Is", "W", "id"),  # still growing into Is_male
    ("_male", "W", "id"),
    (" =", "W", "op"),
    (" 1", "W", "lit"),
    (" AND", "W", "op"),
    (" T1.", "W", "id"),
    ("Singer_ID", "W", "id"),
    (" IN", "W", "op"),
    (" (", "W", "kw"),
    ("SELECT", "P", "kw"),
    (" Singer_ID", "P", "id"),
    (" FROM", "R", "kw"),
    (" singer_in_concert", "R", "id"),
    (")", "W", "kw"),
    (" GROUP BY", "O", "kw"),
    (" T1.", "O", "id"),
    ("Age", "O", "id"),
    (" HAVING", "W", "kw"),
    (" count(", "W", "kw"),
    ("*", "W", "op"),
    (")", "W", "kw"),
    (" >", "W", "op"),
    (" 1", "W", "lit"),
]


@pytest.mark.parametrize("query", [JOIN_QUERY, SUBQUERY_QUERY, NESTED_QUERY], ids=["join", "subquery", "nested"])
@pytest.mark.parametrize("incremental", [True, False])
def test_hand_written_queries(query, incremental):
    t = SqlTagger(SCHEMA, incremental=incremental)
    for chunk, role, kind in query:
        tag = t.step(chunk)
        assert (tag.role, tag.cls, tag.state) == (ROLE[role], *KIND[kind]), chunk
    assert t.text == "".join(c for c, _, _ in query)
    assert not t.degraded


def test_lookahead():
    t = SqlTagger(SCHEMA)
    la = {}
    for chunk in ["SELECT", " T1.", "Name", ",", " Age", " FROM", " singer", " AS", " T1", " JOIN", " concert"]:
        la[chunk] = t.step(chunk).next == Next.LOOKAHEAD_CRITICAL
    for chunk in [" AS", " T2", " ON", " T1.", "Age", " =", " T2.", "Year", " WHERE", " T2.", "Year", " >", " 5"]:
        la[chunk] = t.step(chunk).next == Next.LOOKAHEAD_CRITICAL
    for chunk in [" ORDER BY", " T1.", "Age", " DESC", " LIMIT", " 1", " ", ")"]:
        la[chunk] = t.step(chunk).next == Next.LOOKAHEAD_CRITICAL
    assert {c for c, v in la.items() if v} == {
        "SELECT",
        " T1.",
        ",",
        " FROM",
        " singer",  # may still grow into singer_id / singer_in_concert
        " AS",
        " JOIN",
        " concert",  # concert_id
        " ON",
        " =",  # inside ON: a column follows
        " T2.",
        " WHERE",
        " ORDER BY",
    }
    t.reset()
    assert t.step("SELECT").next == Next.LOOKAHEAD_CRITICAL
    assert t.step(" ").next == Next.LOOKAHEAD_CRITICAL  # whitespace keeps the lookahead
    assert t.step(" Loc") == Tag(TagClass.SCHEMA_BEARING, SqlRole.PROJECTION, State.CRITICAL, Next.LOOKAHEAD_CRITICAL)
    assert t.step("ation").next == Next.NO_LOOKAHEAD
    assert t.step(" FROM").next == Next.LOOKAHEAD_CRITICAL
    assert t.step(" stadium").next == Next.LOOKAHEAD_CRITICAL  # may still grow into stadium_id
    assert t.step(" WHERE").next == Next.LOOKAHEAD_CRITICAL
    assert t.step(" Capacity").next == Next.NO_LOOKAHEAD


def test_whitespace_bytes_and_odd_input():
    t = SqlTagger(SCHEMA)
    assert t.step("SELECT") == Tag(TagClass.PURE_SCAFFOLD, SqlRole.PROJECTION, State.BOUNDARY, Next.LOOKAHEAD_CRITICAL)
    assert t.step("  ") == Tag(TagClass.PURE_SCAFFOLD, SqlRole.PROJECTION, State.STABLE, Next.LOOKAHEAD_CRITICAL)
    t.step(" Name FROM singer WHERE Name = '")
    assert t.step(b"\xc3").cls == TagClass.FREE_GENERATION  # half a character: nothing new yet, still in the string
    assert t.step(b"\xa9'").cls == TagClass.FREE_GENERATION
    assert t.text.endswith("'é'")
    for junk in ["'''", "/*", "*/ x", "``", "[", '"', "--c\n", "\x00", "SELECT [a", "1e", "x'", "))))", "(((", "."]:
        assert t.step(junk) in ALL_TAGS
    assert SqlTagger({}).step("SELECT *") in ALL_TAGS


def test_second_whitespace_token_keeps_the_lookahead():
    """Regression (found by the random-chunk property test): after ``,`` + space, a second
    whitespace-only token re-tokenises an empty tail; the committed state still expects a column."""
    pieces = ["SELECT Age ,", " ", " ", "Name"]
    t, full = SqlTagger(SCHEMA), SqlTagger(SCHEMA, incremental=False)
    inc = [t.step(p) for p in pieces]
    ref = [full.step(p) for p in pieces]
    assert inc == ref
    assert inc[2].next == Next.LOOKAHEAD_CRITICAL


@pytest.mark.parametrize(
    "pieces",
    [
        ["/", "*=SELECT co", "unt(x) FROM players"],  # a comment opened across two tokens stays open
        ["SELECT a FROM t WHERE b = 1 OR c ", "/*", " ", "201", "6"],
        ["SELECT avg(Age) FROM S", "HO", "W,"],  # SHOW mid-statement is a word, not a command
    ],
)
def test_incremental_equals_full_on_split_comments_and_command_words(pieces):
    t, full = SqlTagger(SCHEMA), SqlTagger(SCHEMA, incremental=False)
    assert [t.step(p) for p in pieces] == [full.step(p) for p in pieces]


def test_tokenizer_failure_degrades(monkeypatch):
    t = SqlTagger(SCHEMA)
    t.step("SELECT")

    def boom(_sql):
        raise ValueError("tokenizer failure")

    monkeypatch.setattr(t._tok, "tokenize", boom)
    assert t.step(" Name") == SQL_FALLBACK
    assert t.degraded


# -- Spider dev gold queries ---------------------------------------------------------


def _schemas() -> dict[str, dict[str, list[str]]]:
    out = {}
    for db in json.loads((SPIDER / "tables.json").read_text()):
        names = db["table_names_original"]
        cols: dict[str, list[str]] = {n: [] for n in names}
        for ti, c in db["column_names_original"]:
            if ti >= 0:
                cols[names[ti]].append(c)
        out[db["db_id"]] = cols
    return out


@pytest.fixture(scope="module")
def gold(qwen_tokenizer):
    """(query, schema, token bytes) of every Spider dev gold query."""
    if not (SPIDER / "dev.json").exists():
        pytest.skip(f"Spider dev data not found at {SPIDER}")
    ll = ll_tokenizer(qwen_tokenizer, [qwen_tokenizer.eos_token_id])
    schemas = _schemas()
    out = []
    for ex in json.loads((SPIDER / "dev.json").read_text()):
        ids = qwen_tokenizer(ex["query"], add_special_tokens=False)["input_ids"]
        out.append((ex["query"], schemas[ex["db_id"]], [ll.decode_bytes([i]) for i in ids]))
    return out


def _tag_all(schema, pieces, incremental=True):
    t = SqlTagger(schema, incremental=incremental)
    tags = [t.step(p) for p in pieces]
    return t, tags


def test_gold_every_prefix_tags(gold):
    assert len(gold) == 740
    for query, schema, pieces in gold:
        t, tags = _tag_all(schema, pieces)
        assert t.text == query and not t.degraded, query
        assert all(tag in ALL_TAGS for tag in tags)


def test_gold_incremental_matches_full_retokenisation(gold):
    for query, schema, pieces in gold[::3]:
        assert _tag_all(schema, pieces)[1] == _tag_all(schema, pieces, incremental=False)[1], query


_CLAUSE = {
    TokenType.SELECT: SqlRole.PROJECTION,
    TokenType.FROM: SqlRole.RELATION,
    TokenType.JOIN: SqlRole.RELATION,
    TokenType.ON: SqlRole.PREDICATE,
    TokenType.WHERE: SqlRole.PREDICATE,
    TokenType.HAVING: SqlRole.PREDICATE,
    TokenType.GROUP_BY: SqlRole.OUTSIDE_SCHEMA,
    TokenType.ORDER_BY: SqlRole.OUTSIDE_SCHEMA,
    TokenType.LIMIT: SqlRole.OUTSIDE_SCHEMA,
}


def test_gold_identifier_roles(gold):
    """Tables right after FROM/JOIN are relation; in flat queries every column gets its clause's role."""
    tokenizer = SQLite().tokenizer_class()
    checked_tables = checked_columns = 0
    for query, schema, pieces in gold:
        _, tags = _tag_all(schema, pieces)
        spans, pos, dec = [], 0, codecs.getincrementaldecoder("utf-8")()
        for p in pieces:
            n = len(dec.decode(p))
            spans.append((pos, pos + n))
            pos += n
        tables = {t.lower() for t in schema}
        columns = {c.lower() for cols in schema.values() for c in cols}
        flat = query.upper().count("SELECT") == 1  # no subquery, no set operation
        clause, prev = None, None
        for tok in tokenizer.tokenize(query):
            clause = _CLAUSE.get(tok.token_type, clause)
            name = tok.text.lower()
            inside = [
                tags[k]
                for k, (s, e) in enumerate(spans)
                if s >= tok.start and e <= tok.end + 1 and query[s:e].strip() == query[s:e]
            ]
            if name in tables and prev in (TokenType.FROM, TokenType.JOIN):
                for tag in inside:
                    assert (tag.role, tag.cls, tag.state) == (
                        SqlRole.RELATION,
                        TagClass.SCHEMA_BEARING,
                        State.CRITICAL,
                    ), (query, tok.text)
                    checked_tables += 1
            elif flat and name in columns and clause is not None and prev != TokenType.ALIAS:
                for tag in inside:
                    assert (tag.role, tag.state) == (clause, State.CRITICAL), (query, tok.text)
                    checked_columns += 1
            prev = tok.token_type
    assert checked_tables > 500 and checked_columns > 1000


def test_comments_and_whitespace_match_full_retokenisation():
    chunks = ["SELECT", " a", " --", " note", " ", "more", "\n", " FROM", " t", " /*", " x ", "*/", " WHERE", " b"]
    tags = [_tag_all({"t": ["a", "b"]}, [c.encode() for c in chunks], incremental=inc)[1] for inc in (True, False)]
    assert tags[0] == tags[1]
    assert tags[0][-1] == Tag(TagClass.SCHEMA_BEARING, SqlRole.PREDICATE, State.CRITICAL, Next.NO_LOOKAHEAD)
    assert tags[0][3].role == SqlRole.PROJECTION and tags[0][3].cls == TagClass.PURE_SCAFFOLD  # comment text


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_chunks_and_junk_match_full_retokenisation(gold, data):
    """Any split of any (possibly damaged) query tags the same incrementally and from scratch."""
    query, schema, _ = data.draw(st.sampled_from(gold))
    for _ in range(data.draw(st.integers(0, 3))):
        k = data.draw(st.integers(0, len(query)))
        query = query[:k] + data.draw(st.text(alphabet="'\"`[]()-/* \n=<>!.,;é", max_size=3)) + query[k:]
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(query) - 1)), max_size=len(query) // 2)))
    chunks = [query[a:b] for a, b in zip([0, *cuts], [*cuts, len(query)], strict=True) if b > a]
    inc, full = SqlTagger(schema), SqlTagger(schema, incremental=False)
    for chunk in chunks:
        assert inc.step(chunk) == full.step(chunk), (query, chunks)
    assert inc.text == query
