"""The scope analysis of SQL queries (issue 28): every column a (sub-)query names must come from its FROM clause."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pask.structure.sql_scope import ScopeState, scope_errors
from pask.tasks.text_to_sql import load_cases, load_schema


@pytest.fixture(scope="module")
def poker():
    return load_schema("poker_player")


@pytest.fixture(scope="module")
def concert():
    return load_schema("concert_singer")


def _names(sql: str, schema) -> list[str]:
    return [e.name for e in scope_errors(sql, schema)]


@pytest.mark.parametrize(
    ("sql", "missing"),
    [
        # the examples: Name and Height are columns of people, not of poker_player
        ("SELECT Name FROM poker_player ORDER BY Earnings DESC", ["name"]),
        ("SELECT AVG(Earnings) FROM poker_player WHERE Height > 200", ["height"]),
        ("SELECT T1.Height FROM poker_player AS T1", ["t1.height"]),  # qualified: T1 is poker_player
        ("SELECT T3.Name FROM people AS T1", ["t3.name"]),  # an unbound qualifier
        ("SELECT Name FROM people WHERE People_ID IN (SELECT People_ID FROM poker_player WHERE Height > 1)", []),
        # GROUP BY / ORDER BY of a sub-query see its own tables only (SQLite), WHERE sees the outer ones
        ("SELECT Name FROM people WHERE People_ID IN (SELECT People_ID FROM poker_player GROUP BY Height)", ["height"]),
        ("SELECT Name FROM people WHERE People_ID IN (SELECT People_ID FROM poker_player ORDER BY Name)", ["name"]),
    ],
)
def test_out_of_scope_columns_are_named(poker, sql, missing):
    assert _names(sql, poker) == missing


@pytest.mark.parametrize(
    "sql",
    [
        # an alias used in SELECT and bound later in FROM
        "SELECT T1.Name, T2.Earnings FROM people AS T1 JOIN poker_player AS T2 ON T1.People_ID = T2.People_ID",
        # the same table twice under two aliases
        "SELECT T1.Name FROM people AS T1 JOIN people AS T2 ON T1.People_ID = T2.People_ID JOIN poker_player AS T3 "
        "ON T3.People_ID = T2.People_ID",
        # select aliases in ORDER BY and HAVING
        "SELECT Nationality, COUNT(*) AS cnt FROM people GROUP BY Nationality HAVING cnt > 1 ORDER BY cnt DESC",
        # a derived table (its columns are not checked) and a correlated sub-query in WHERE
        "SELECT T.n FROM (SELECT Name AS n FROM people) AS T",
        "SELECT Name FROM people AS P WHERE EXISTS (SELECT 1 FROM poker_player WHERE People_ID = P.People_ID)",
        # set operations: each core has its own FROM
        "SELECT Name FROM people WHERE Height > 190 UNION SELECT Name FROM people WHERE Birth_Date LIKE '%1980%'",
        "SELECT People_ID FROM poker_player INTERSECT SELECT People_ID FROM people ORDER BY People_ID",
        # a double-quoted word names a column in scope or is a string (SQLite): never out of scope
        'SELECT Name FROM people WHERE Nationality = "Earnings"',
        # CAST types, functions and aggregates are not columns
        "SELECT CAST(Height AS INTEGER), max(Height), lower(Name) FROM people",
        'SELECT "Name" FROM people',
        # 'AS' glued to its alias (the grammar forces no space; seen on the tiny model): an alias, not a column
        "SELECT MAX(Height) AStop FROM people ASP CROSS JOIN poker_player ORDER BY top",
        "SELECT Name FROM people ASp WHERE p.Height > 1",
    ],
)
def test_in_scope_queries_pass(poker, sql):
    assert _names(sql, poker) == []


def test_a_missing_column_is_an_error_until_a_join_provides_it(poker):
    """What a decoder asks before it lets the FROM clause end: the open frame's errors so far."""
    state = ScopeState(poker)
    state.feed("SELECT Name FROM poker_player")
    assert [e.name for e in state.frame_errors()] == ["name"]
    state.feed(" JOIN people ON poker_player.People_ID = people.People_ID")
    assert state.frame_errors() == [] and state.errors() == []


def test_each_sub_query_has_its_own_scope(concert):
    inner = "SELECT Singer_ID FROM singer_in_concert"
    assert _names(f"SELECT Name FROM singer WHERE Singer_ID IN ({inner})", concert) == []
    # Capacity is a column of stadium: neither the sub-query's table nor the outer one has it
    assert _names(f"SELECT Name FROM singer WHERE Singer_ID IN ({inner} WHERE Capacity > 1)", concert) == ["capacity"]
    # an alias bound inside a sub-query is not visible outside it
    sql = f"SELECT T2.Name FROM singer AS T1 WHERE Singer_ID IN ({inner} AS T2)"
    assert _names(sql, concert) == ["t2.name"]
    # the outer query's alias is visible inside (a correlated sub-query)
    sql = "SELECT Name FROM singer AS T1 WHERE EXISTS (SELECT 1 FROM singer_in_concert WHERE Singer_ID = T1.Singer_ID)"
    assert _names(sql, concert) == []


def test_every_gold_query_of_spider_dev_is_in_scope():
    schemas: dict = {}
    flagged = []
    cases = load_cases()
    assert len(cases) == 740
    for case in cases:
        schema = schemas.setdefault(case.db_id, load_schema(case.db_id))
        errors = scope_errors(case.gold_sql, schema)
        if errors:
            flagged.append(f"{case.id}: {[str(e) for e in errors]} {case.gold_sql}")
    assert not flagged, "\n".join(flagged)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(range(740)), st.sampled_from(["upper", "lower", "spaces"]))
def test_gold_queries_stay_in_scope_with_other_case_and_spacing(i, how):
    case = load_cases()[i]
    sql = case.gold_sql
    if how == "spaces":
        sql = sql.replace(" ", "   ").replace(",", " , ").replace("(", " ( ")
    elif "'" not in sql and '"' not in sql:  # literals keep their case
        sql = sql.upper() if how == "upper" else sql.lower()
    assert scope_errors(sql, load_schema(case.db_id)) == []


# -- scope-aware decoding: the constraint's masks ---------------------------------------------------
@pytest.fixture(scope="module")
def qwen_ll(qwen_tokenizer):
    from pask.runtime.tokens import eos_ids
    from pask.structure.constraint import ll_tokenizer

    eos = eos_ids(qwen_tokenizer)
    return qwen_tokenizer, ll_tokenizer(qwen_tokenizer, eos), eos


def _scoped(qwen_ll, db_id: str, text: str = ""):
    """A ScopedConstraint on ``db_id`` that has consumed ``text``."""
    from pask.structure.sql_grammar import sql_grammar
    from pask.structure.sql_scope import ScopedConstraint

    tok, ll, eos = qwen_ll
    schema = load_schema(db_id)
    c = ScopedConstraint(ll, sql_grammar(schema), schema, eos)
    for t in tok.encode(text, add_special_tokens=False):
        c.consume(t)
    return c


def _allowed(c, token_ids: list[int]) -> list[bool]:
    from pask.structure.constraint import allocate_mask

    bm = allocate_mask(1, c.vocab_size)
    c.mask(bm, 0)
    return [bool((int(bm[0, t >> 5]) >> (t & 31)) & 1) for t in token_ids]


def _ids(qwen_ll, *words: str) -> list[int]:
    """The first token of each word (a prefix: the masks judge prefixes of names)."""
    tok = qwen_ll[0]
    return [tok.encode(w, add_special_tokens=False)[0] for w in words]  # the first token of each word


def test_decoding_rejects_an_out_of_scope_column_after_from(qwen_ll):
    c = _scoped(qwen_ll, "poker_player", "SELECT AVG(Earnings) FROM poker_player WHERE")
    assert _allowed(c, _ids(qwen_ll, " Height", " Earnings")) == [False, True]
    c = _scoped(qwen_ll, "poker_player", "SELECT Name FROM people AS T1 WHERE T1.")
    assert _allowed(c, _ids(qwen_ll, "Height", "Earnings")) == [True, False]


def test_decoding_forces_a_join_before_the_query_closes(qwen_ll):
    eos = qwen_ll[2][0]
    c = _scoped(qwen_ll, "poker_player", "SELECT Name FROM poker_player")
    assert _allowed(c, [eos, *_ids(qwen_ll, " ORDER", " WHERE", ";", " JOIN")]) == [False] * 4 + [True]
    c = _scoped(
        qwen_ll,
        "poker_player",
        "SELECT Name FROM poker_player JOIN people ON poker_player.People_ID = people.People_ID",
    )
    assert _allowed(c, [eos, *_ids(qwen_ll, " ORDER", " WHERE")]) == [True, True, True]


def test_decoding_forces_the_join_before_group_by_too(qwen_ll):
    """GROUP opens GROUP_CONCAT as well, but not in a FROM clause (seen on the real model)."""
    eos = qwen_ll[2][0]
    c = _scoped(qwen_ll, "poker_player", "SELECT Birth_Date FROM poker_player")
    assert _allowed(c, [eos, *_ids(qwen_ll, " GROUP", " ORDER", " JOIN")]) == [False, False, False, True]


def test_decoding_checks_a_token_that_carries_the_dot_and_the_column(qwen_ll):
    """Seen on the real model: '.Directed_by' after 'T2' (TV_Channel, which has no Directed_by)."""
    tok = qwen_ll[0]
    c = _scoped(
        qwen_ll, "tvshow", "SELECT T1.Title FROM Cartoon AS T1 JOIN TV_Channel AS T2 ON T1.Channel = T2.id WHERE T2"
    )
    bad, good = tok.encode(".Directed_by")[0], tok.encode(".series_name")[0]
    assert tok.decode([bad]).startswith(".D") and tok.decode([good]).startswith(".s")
    assert _allowed(c, [bad, good]) == [False, True]


def test_decoding_checks_an_identifier_when_the_next_token_ends_it(qwen_ll):
    """Seen on the real model: 'ORDER BY Date' (the grammar takes Date as an ORDER BY alias; Cartoon has no Date)."""
    eos = qwen_ll[2][0]
    c = _scoped(qwen_ll, "tvshow", "SELECT Production_code FROM Cartoon ORDER BY Date")
    assert _allowed(c, [eos, *_ids(qwen_ll, " DESC")]) == [False, False]
    c = _scoped(qwen_ll, "tvshow", "SELECT Production_code FROM Cartoon ORDER BY Title")
    assert _allowed(c, [eos, *_ids(qwen_ll, " DESC")]) == [True, True]


def test_decoding_lets_an_alias_be_bound_later_in_from(qwen_ll):
    eos = qwen_ll[2][0]
    c = _scoped(qwen_ll, "poker_player", "SELECT T1.Name FROM people AS T1")
    assert _allowed(c, [eos]) == [True]
    c = _scoped(qwen_ll, "poker_player", "SELECT T2.Name FROM people AS T1")  # T2 never bound: no end yet
    assert _allowed(c, [eos, *_ids(qwen_ll, " JOIN")]) == [False, True]


def test_decoding_gives_a_sub_query_its_own_scope(qwen_ll):
    text = "SELECT Name FROM people WHERE People_ID IN (SELECT People_ID FROM poker_player"
    c = _scoped(qwen_ll, "poker_player", text + " GROUP BY")
    assert _allowed(c, _ids(qwen_ll, " Height", " Earnings")) == [False, True]  # GROUP BY: its own tables
    c = _scoped(qwen_ll, "poker_player", text + " WHERE")
    assert _allowed(c, _ids(qwen_ll, " Height", " Earnings")) == [True, True]  # WHERE: the outer ones too
    # Capacity is stadium's: the sub-query cannot end before it joins stadium
    c = _scoped(qwen_ll, "concert_singer", "SELECT Name FROM singer WHERE Singer_ID IN (SELECT Capacity FROM concert")
    assert _allowed(c, _ids(qwen_ll, ")", " JOIN")) == [False, True]


def test_decoding_refuses_an_alias_whose_table_lacks_what_is_named_through_it(qwen_ll):
    """Seen on the real model: 'SELECT T2.AirportCode ... JOIN flights AS T2', then JOINs to the token limit."""
    text = "SELECT T2.AirportCode FROM airports AS T1 JOIN flights AS"
    c = _scoped(qwen_ll, "flight_2", text)
    assert _allowed(c, _ids(qwen_ll, " T", " flights_table")) == [True, True]
    c = _scoped(qwen_ll, "flight_2", text + " T")  # Qwen writes T2 as ' T' and '2'
    assert _allowed(c, _ids(qwen_ll, "2", "3")) == [False, True]
    c = _scoped(qwen_ll, "flight_2", "SELECT T2.AirportCode FROM airports AS T1 JOIN airports AS T")
    assert _allowed(c, _ids(qwen_ll, "1", "2")) == [False, True]  # T1 is taken in this FROM clause


def test_decoding_joins_toward_a_table_that_has_the_missing_column(qwen_ll):
    """flight_2 declares no foreign key to airlines: a JOIN toward AirportName cannot go there."""
    c = _scoped(qwen_ll, "flight_2", "SELECT AirportName FROM flights JOIN")
    assert _allowed(c, _ids(qwen_ll, " airports", " airlines")) == [True, False]
    c = _scoped(qwen_ll, "flight_2", "SELECT AirportName FROM flights JOIN airports ON flights.SourceAirport = ")
    assert _allowed(c, _ids(qwen_ll, " airports")) == [True]  # nothing is missing any more: no restriction


def test_decoding_lets_a_query_end_when_no_join_can_mend_it(qwen_ll):
    """A qualifier bound to a table without the column, or a FROM clause past the cap: no endless JOINs."""
    eos = qwen_ll[2][0]
    c = _scoped(
        qwen_ll, "battle_death", "SELECT T2.note FROM death AS T1 JOIN ship AS T2 ON T1.caused_by_ship_id = T2.id"
    )
    assert _allowed(c, [eos]) == [True]
    joins = " JOIN people AS T{0} ON T1.People_ID = T{0}.People_ID"
    text = "SELECT T9.Earnings FROM people AS T1" + "".join(joins.format(i) for i in (2, 3, 4))
    c = _scoped(qwen_ll, "poker_player", text)  # 4 table references: the cap for 2 tables
    assert _allowed(c, [eos]) == [True]
    c = _scoped(qwen_ll, "poker_player", "SELECT T9.Earnings FROM people AS T1" + joins.format(2))
    assert _allowed(c, [eos]) == [False]


def test_decoding_checks_dot_tokens_of_unbound_qualifiers_and_quoted_names(qwen_ll):
    """Seen on the real model: 'SELECT T1.Name, T1.Theme' (no table has both; '.Theme' is one token)
    and "ORDER BY T2.`18_49_Rating_Share`" ('.`' is one token; T2's table quotes no name)."""
    tok = qwen_ll[0]
    dot = lambda w: tok.encode(w, add_special_tokens=False)[0]  # noqa: E731
    assert tok.decode([dot(".Theme")]) == ".Theme" and tok.decode([dot(".`")]) == ".`"
    c = _scoped(qwen_ll, "concert_singer", "SELECT T1.Name, T1")
    assert _allowed(c, [dot(".Theme"), dot(".Country"), dot(".Location")]) == [False, True, True]
    join = "SELECT T1.Title FROM Cartoon AS T1 JOIN TV_Channel AS T2 ON T1.Channel = T2.id"
    c = _scoped(qwen_ll, "tvshow", join + " ORDER BY T2")
    assert _allowed(c, [dot(".`"), dot(".id")]) == [False, True]
    c = _scoped(qwen_ll, "tvshow", "SELECT T3.Episode FROM TV_series AS T3 ORDER BY T3")  # it has `18_49_Rating_Share`
    assert _allowed(c, [dot(".`")]) == [True]


def test_decoding_needs_a_from_clause_for_the_columns_of_a_select_list(qwen_ll):
    """Seen on the tiny model: 'SELECT singer_name.SINGER_ID, SINGER."CountrY"' and EOS, no FROM."""
    eos = qwen_ll[2][0]
    assert _allowed(_scoped(qwen_ll, "concert_singer", "SELECT T1.Name"), [eos, *_ids(qwen_ll, " FROM")]) == [
        False,
        True,
    ]
    assert _allowed(_scoped(qwen_ll, "concert_singer", "SELECT 1"), [eos]) == [True]


def test_decoding_does_not_start_a_set_operation_through_a_shorter_token(qwen_ll):
    """Seen on the real model: EXCEPT written ' EX' + 'CEPT'; after ' EX' the grammar allows EXCEPT only."""
    text = "SELECT T2.AirportName FROM airports AS T1 JOIN flights AS T3 ON T1.AirportCode = T3.SourceAirport"
    c = _scoped(qwen_ll, "flight_2", text)
    assert qwen_ll[0].decode(_ids(qwen_ll, " EXCEPT")) == " EX"
    assert _allowed(c, _ids(qwen_ll, " EXCEPT", " JOIN")) == [False, True]


def test_decoding_refuses_a_quoted_column_after_a_qualifier_whose_table_needs_no_quotes(qwen_ll):
    """Seen on the real model: 'ORDER BY T2.`18_49_Rating_Share`' with T2 TV_Channel."""
    tok = qwen_ll[0]
    c = _scoped(
        qwen_ll, "tvshow", "SELECT T1.Title FROM Cartoon AS T1 JOIN TV_Channel AS T2 ON T1.Channel = T2.id ORDER BY T2."
    )
    quote = tok.encode("`", add_special_tokens=False)[0]
    assert _allowed(c, [quote, *_ids(qwen_ll, "id")]) == [False, True]


@pytest.mark.slow  # ~25 s: every token of 740 queries through the grammar and scope masks
def test_every_gold_query_decodes_under_the_scope_constraint(qwen_ll):
    """Each of the 740 gold queries, token by token: every token allowed, then EOS allowed."""
    from pask.structure.constraint import allocate_mask
    from pask.structure.sql_grammar import sql_grammar
    from pask.structure.sql_scope import ScopedConstraint

    tok, ll, eos = qwen_ll
    grammars: dict = {}
    refused = []
    for case in load_cases():
        schema, grammar = grammars.get(case.db_id) or grammars.setdefault(
            case.db_id, (load_schema(case.db_id), sql_grammar(load_schema(case.db_id)))
        )
        c = ScopedConstraint(ll, grammar, schema, eos)
        bm = allocate_mask(1, c.vocab_size)
        for t in [*tok.encode(case.gold_sql, add_special_tokens=False), eos[0]]:
            c.mask(bm, 0)
            if not (int(bm[0, t >> 5]) >> (t & 31)) & 1:
                refused.append(f"{case.id} at {c.text!r} + {tok.decode([t])!r}: {case.gold_sql}")
                break
            if t != eos[0]:
                c.consume(t)
        assert c.fallbacks == 0, case.id
    assert not refused, "\n".join(refused[:20])


def test_sql_scope_option_builds_the_scoped_constraint_and_its_outputs_are_in_scope(smol, tmp_path):
    """``pask eval sql --sql-scope on`` on the tiny model: every query that ended (not cut at the
    token limit) is in scope and none fails with 'no such column'; ``off`` keeps the grammar alone."""
    from pask.evaluation.runner import prepare, run_task
    from pask.structure.constraint import Constraint
    from pask.structure.sql_scope import ScopedConstraint
    from pask.tasks import get_task
    from pask.tasks.sql import select_cases

    sql = get_task("sql")
    cases = [c for c in select_cases("test") if c.db_id in ("poker_player", "concert_singer")][:6]
    on, _ = prepare(sql, smol, cases[0], 8, sql_scope="on")
    off, _ = prepare(sql, smol, cases[0], 8, sql_scope="off")
    assert isinstance(on.constraint, ScopedConstraint) and type(off.constraint) is Constraint
    default, _ = prepare(sql, smol, cases[0], 8, **sql.resolve_options({}))
    assert isinstance(default.constraint, ScopedConstraint)  # on by default
    run_task(sql, smol, cases, tmp_path, batch_size=3, max_new_tokens=48, sql_scope="on")
    rows = [json.loads(x) for x in (tmp_path / "cases.jsonl").read_text().splitlines()]
    assert len(rows) == len(cases)
    for r in rows:  # a query cut at the token limit may be cut anywhere; one that ended is in scope
        if r["stop_reason"] in ("eos", "grammar"):
            assert "no such column" not in (r["error"] or ""), r
            assert scope_errors(r["output"], load_schema(r["db_id"])) == [], r["output"]


def test_decoding_keeps_a_keyword_apart_from_the_next_word(qwen_ll):
    """``WHEREname``, ``ORDERBY`` and ``LIMIT10`` lex as two lexemes each (whitespace is ignored);
    the constraint refuses them, and keeps what goes on into a longer word."""
    c = _scoped(qwen_ll, "poker_player", "SELECT count(DISTINCT Nationality) FROM people WHERE")
    assert _allowed(c, _ids(qwen_ll, "Nationality", " Nationality")) == [False, True]
    c = _scoped(qwen_ll, "poker_player", "SELECT Name FROM people ORDER")
    assert _allowed(c, _ids(qwen_ll, "BY", " BY")) == [False, True]
    c = _scoped(qwen_ll, "poker_player", "SELECT Name FROM people LIMIT")
    assert _allowed(c, _ids(qwen_ll, "1", " 1")) == [False, True]
    c = _scoped(qwen_ll, "poker_player", "SELECT Name FROM people WHERE Height > 1 OR")
    assert _allowed(c, _ids(qwen_ll, "DER", " Height")) == [True, True]  # OR -> ORDER
    c = _scoped(qwen_ll, "poker_player", "SELECT count(*) AS order")
    assert _allowed(c, _ids(qwen_ll, "_cnt")) == [True]  # an alias is being written
    c = _scoped(qwen_ll, "poker_player", "SELECT count(*) AS order_cnt FROM people ORDER BY order")
    assert _allowed(c, _ids(qwen_ll, "_cnt")) == [True]  # ... and named again
    c = _scoped(qwen_ll, "poker_player", "SELECT Name FROM people WHERE Name = 'FROM")
    assert _allowed(c, _ids(qwen_ll, "age")) == [True]  # inside a literal
