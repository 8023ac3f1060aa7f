"""Per-database llguidance Lark grammar for a SQLite SELECT subset, plus a model-free checker.

The language: SELECT [DISTINCT] items [FROM tables/subqueries with JOIN ... ON/USING and
aliases] [WHERE] [GROUP BY [HAVING]], chained with UNION [ALL] / INTERSECT / EXCEPT, then
[ORDER BY ... ASC/DESC] [LIMIT n [OFFSET n]], optionally ended by ``;``. Expressions: string
('...' or "...") and number literals, NULL, column references, arithmetic (+ - * / % ||),
comparisons, AND/OR/NOT, [NOT] IN (list or subquery), [NOT] LIKE, [NOT] BETWEEN, IS [NOT] NULL,
[NOT] EXISTS, scalar subqueries, COUNT/SUM/AVG/MIN/MAX (COUNT(*), DISTINCT), a few scalar
functions, CAST and CASE.

Schema binding: table names and column names are terminals built from the database's schema
(case-insensitive; also quoted as "x", `x` or [x]; names that are not plain words can only be
written quoted). A column may be qualified by a table name or by any alias-shaped identifier
(T1, t2, ...). Aliases of tables, subqueries and select items are any identifier except the
grammar's keywords and must follow ``AS`` (all Spider gold queries write ``AS``): the lexer is
greedy with one byte of lookahead, so an alias allowed right after a name would let
``FROM singers`` or ``FROM singer_x`` pass as table ``singer`` plus an alias. One deliberate
loosening (``order_by_aliases``, on by default): an ORDER BY term may be a bare alias-shaped
identifier, so ``ORDER BY cnt`` after ``COUNT(*) AS cnt`` stays expressible.

Whitespace between lexemes is free (``%ignore``); for the same lexer reason a keyword is not
forced apart from the next word (``SELECTname`` parses; SQLite then rejects it; the scope
constraint, :class:`pask.structure.sql_scope.ScopedConstraint`, refuses it). A complete
query is an accepting state, so EOS may end it; after ``;`` the matcher is stopped and only
EOS is allowed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import llguidance

from pask.errors import PaskError
from pask.structure.sql_schema import Schema, is_bare_identifier

_KEYWORD_TEXT = """
all and as asc between by case cast collate create cross delete desc distinct drop else end
escape except exists from full glob group having in inner insert intersect into is join left
limit natural not null offset on or order outer right select set table then union update using
values when where with
"""
KEYWORDS = tuple(_KEYWORD_TEXT.split())
AGGREGATES = ("count", "sum", "avg", "min", "max", "total", "group_concat")
_FUNCTION_TEXT = """
abs length lower upper round substr substring instr trim ltrim rtrim replace coalesce ifnull
nullif iif strftime date time datetime julianday typeof
"""
FUNCTIONS = tuple(_FUNCTION_TEXT.split())
CAST_TYPES = ("integer", "int", "real", "float", "double", "numeric", "decimal", "text", "varchar", "char", "blob")

_RULES = r"""
%ignore /[ \t\r\n]+/

start: query ";"?

query: select_core (compound_op select_core)* order_by? limit?
compound_op: "UNION"i "ALL"i? | "INTERSECT"i | "EXCEPT"i
select_core: "SELECT"i "DISTINCT"i? select_items from_clause? where? group_by?
select_items: select_item ("," select_item)*
select_item: "*" | qualifier "." "*" | expr ("AS"i alias)?
alias: ALIAS | STRING

from_clause: "FROM"i table_ref (join_op table_ref join_cond?)*
table_ref: TABLE ("AS"i ALIAS)? | "(" query ")" ("AS"i ALIAS)?
join_op: "," | "NATURAL"i? ("LEFT"i "OUTER"i? | "INNER"i | "CROSS"i)? "JOIN"i
join_cond: "ON"i expr | "USING"i "(" column ("," column)* ")"

where: "WHERE"i expr
group_by: "GROUP"i "BY"i expr ("," expr)* ("HAVING"i expr)?
order_by: "ORDER"i "BY"i order_term ("," order_term)*
order_term: order_key ("ASC"i | "DESC"i)?
limit: "LIMIT"i INT (("OFFSET"i | ",") INT)?

expr: or_expr
or_expr: and_expr ("OR"i and_expr)*
and_expr: not_expr ("AND"i not_expr)*
not_expr: "NOT"i not_expr | predicate
predicate: sum
    | sum CMP sum
    | sum "NOT"i? "IN"i "(" (query | expr ("," expr)*) ")"
    | sum "NOT"i? "LIKE"i sum
    | sum "NOT"i? "BETWEEN"i sum "AND"i sum
    | sum "IS"i "NOT"i? "NULL"i
    | "EXISTS"i "(" query ")"
sum: product (("+" | "-" | "||") product)*
product: unary (("*" | "/" | "%") unary)*
unary: ("-" | "+") unary | primary
primary: literal
    | column_ref
    | AGGREGATE "(" "*" ")"
    | AGGREGATE "(" "DISTINCT"i? expr ("," expr)* ")"
    | FUNCTION "(" (expr ("," expr)*)? ")"
    | "CAST"i "(" expr "AS"i CAST_TYPE ")"
    | "CASE"i expr? ("WHEN"i expr "THEN"i expr)+ ("ELSE"i expr)? "END"i
    | "(" expr ")"
    | "(" query ")"
literal: NUMBER | STRING | "NULL"i
column_ref: (qualifier ".")? column
qualifier: TABLE | ALIAS
column: COLUMN

CMP: "=" | "==" | "!=" | "<>" | "<" | "<=" | ">" | ">="
INT: /[0-9]+/
NUMBER: /[0-9]+(\.[0-9]*)?([eE][+-]?[0-9]+)?/ | /\.[0-9]+([eE][+-]?[0-9]+)?/
STRING: /'([^']|'')*'/ | /"([^"]|"")*"/
"""


def _alternatives(words: list[str] | tuple[str, ...], form=re.escape) -> str:
    """``words`` as regex alternatives, longest first, each written by ``form``."""
    return "|".join(form(w) for w in sorted(set(words), key=lambda w: (-len(w), w)))


def _ascii_case_free(word: str) -> str:
    """A regex for ``word`` in any ASCII letter case: SQLite folds ASCII letters only (``(?i)`` would
    also fold ``ſ`` to ``s`` and ``K`` to ``k``: ``loſt_in_battle`` passed, SQLite rejected it)."""
    return "".join(f"[{c.lower()}{c.upper()}]" if c.isascii() and c.isalpha() else re.escape(c) for c in word)


def _names_terminal(names: list[str]) -> str:
    """A regex terminal for schema identifiers in any ASCII case, bare (if possible) or quoted."""
    bare = [n for n in names if is_bare_identifier(n)]
    forms = [
        '"(?:' + _alternatives([n.replace('"', '""') for n in names], _ascii_case_free) + ')"',
        "`(?:" + _alternatives([n.replace("`", "``") for n in names], _ascii_case_free) + ")`",
        r"\[(?:" + _alternatives([n for n in names if "]" not in n], _ascii_case_free) + r")\]",
    ]
    if bare:
        forms.insert(0, _alternatives(bare, _ascii_case_free))
    return "/(?:" + "|".join(forms) + ")/"


def sql_grammar(schema: Schema, order_by_aliases: bool = True) -> str:
    """The Lark grammar (llguidance dialect) of SELECT queries over ``schema``'s tables and columns.

    ``order_by_aliases``: also allow a bare alias-shaped identifier as an ORDER BY term.
    """
    tables = [t.name for t in schema.tables]
    columns = schema.column_names()
    lines = [
        f"// SQLite SELECT grammar for database {schema.db_id}",
        _RULES,
        "order_key: expr | ALIAS" if order_by_aliases else "order_key: expr",
        f"TABLE: {_names_terminal(tables)}",
        f"COLUMN: {_names_terminal(columns)}",
        f"AGGREGATE: /(?i:{_alternatives(AGGREGATES)})/",
        f"FUNCTION: /(?i:{_alternatives(FUNCTIONS)})/",
        f"CAST_TYPE: /(?i:{_alternatives(CAST_TYPES)})/",
        f"ALIAS: /[A-Za-z_][A-Za-z0-9_]*/ & ~/(?i:{_alternatives(KEYWORDS)})/",
    ]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class GrammarCheck:
    """Outcome of checking one query: ``accepted``, else where (char offset) and why it stopped."""

    accepted: bool
    offset: int | None = None
    detail: str = ""


class SqlGrammarChecker:
    """Checks SQL strings against one database's grammar by feeding their tokens to a matcher.

    ``tokenizer`` is a Hugging Face tokenizer and ``ll_tokenizer`` its llguidance view; the
    matcher is built once and reset between queries.
    """

    def __init__(
        self, schema: Schema, tokenizer: object, ll_tokenizer: llguidance.LLTokenizer, order_by_aliases: bool = True
    ) -> None:
        grammar = llguidance.LLMatcher.grammar_from_lark(sql_grammar(schema, order_by_aliases))
        error = llguidance.LLMatcher.validate_grammar(grammar, ll_tokenizer)
        if error:
            raise PaskError(f"invalid SQL grammar for {schema.db_id}: {error}")
        self._tok = tokenizer
        self._m = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)

    def check(self, sql: str) -> GrammarCheck:
        self._m.reset()
        ids = self._tok.encode(sql, add_special_tokens=False)
        n = self._m.validate_tokens(ids)
        if n < len(ids):
            offset = len(self._tok.decode(ids[:n]))
            return GrammarCheck(False, offset, f"token {n} ({self._tok.decode(ids[n : n + 1])!r}) rejected")
        self._m.consume_tokens(ids)
        if self._m.is_error():
            return GrammarCheck(False, len(sql), self._m.get_error())
        if not self._m.is_accepting():
            return GrammarCheck(False, len(sql), "query incomplete")
        return GrammarCheck(True)
