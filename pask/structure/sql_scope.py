"""Scope of a SQL query: which columns each (sub-)query may name, given its FROM clause.

The SQL grammar (:mod:`pask.structure.sql_grammar`) binds names to the database's schema but not
to the query's scope: any column of the database is legal anywhere. :class:`ScopeState` follows a
query text left to right, with a frame per (sub-)query, and records

* the tables of each frame's FROM / JOIN list and their aliases (``table AS T1``, ``(query) AS T``),
* the unqualified column names referenced, and the qualified ones (``T1.name``, ``people.name``),
* the select-item aliases (``COUNT(*) AS cnt``), which later clauses may name.

A frame is *in scope* when every column it names is provided: an unqualified name by one of its
tables (or by a table of an enclosing query: correlated sub-queries), a select alias, or a derived
table; a qualified name by the table its qualifier binds, which must be bound in the frame or an
enclosing one. :meth:`ScopeState.errors` lists what is not, in SQLite's words (``no such column``),
for a complete query; :meth:`ScopeState.frame_errors` does so for the innermost open frame, which is
what a decoder asks before it lets the FROM clause end (issue 28: scope-aware decoding).

Set operations start a fresh core in the same frame (each core has its own FROM); an ORDER BY
after a compound names the result's columns and is not checked.
"""

from __future__ import annotations

import re
import time
from collections import deque
from dataclasses import dataclass, field, replace
from functools import lru_cache

import llguidance
import numpy as np
import torch

from pask.structure.constraint import Constraint
from pask.structure.sql_grammar import AGGREGATES, CAST_TYPES, FUNCTIONS, KEYWORDS
from pask.structure.sql_schema import Schema, is_bare_identifier

_LEXEME = re.compile(
    r"""(?P<ws>\s+)
    |(?P<str>'(?:[^']|'')*'?)
    |(?P<qid>"(?:[^"]|"")*"?|`(?:[^`]|``)*`?|\[[^\]]*\]?)
    |(?P<num>[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?|\.[0-9]+)
    |(?P<id>[A-Za-z_][A-Za-z0-9_]*)
    |(?P<op><>|<=|>=|!=|==|\|\||.)""",
    re.X | re.S,
)
_KEYWORDS = frozenset((*KEYWORDS, "like"))  # the grammar writes LIKE as a literal of its rules
_CALLABLE = frozenset((*AGGREGATES, *FUNCTIONS))
_CLAUSE_OF = {"where": "where", "group": "group", "having": "having", "order": "order", "limit": "limit"}
_COMPOUND = frozenset(("union", "intersect", "except"))


@dataclass(frozen=True)
class ScopeError:
    """One name out of scope: ``kind`` is ``no such column`` (SQLite's wording); ``name`` as written."""

    kind: str
    name: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.name}"


@dataclass
class Frame:
    """One (sub-)query's scope; ``depth``: the parenthesis depth its text runs at."""

    depth: int
    clause: str = "select"
    tables: dict[str, str | None] = field(default_factory=dict)  # binding name (lower) -> table (lower); None: derived
    columns: list[tuple[str, str]] = field(default_factory=list)  # unqualified (column, clause) referenced
    qualified: list[tuple[str, str]] = field(default_factory=list)  # (qualifier, column) referenced
    aliases: set[str] = field(default_factory=set)  # select-item aliases (lower)
    compound: bool = False  # a set operation has been seen: the ORDER BY names result columns
    finished: list[ScopeError] = field(default_factory=list)  # errors of earlier cores of a compound
    refs: int = 0  # table references written in this core's FROM clause (a self-join counts twice)


def _unquote(text: str) -> str:
    if text[:1] in '"`' and len(text) >= 2 and text[-1] == text[0]:
        return text[1:-1].replace(text[0] * 2, text[0])
    if text[:1] == "[" and text.endswith("]"):
        return text[1:-1]
    return text


def _open_literal(last: re.Match | None) -> bool:
    """Whether the lexeme ``last`` is a string literal or a quoted name still open."""
    if last is None or last.lastgroup not in ("str", "qid"):
        return False
    lexeme = last.group()
    close = {"'": "'", '"': '"', "`": "`", "[": "]"}[lexeme[0]]
    if len(lexeme) == 1 or not lexeme.endswith(close):
        return True
    return close != "]" and len(lexeme) > 2 and lexeme.endswith(close * 2)  # an escaped quote, still open


class ScopeState:
    """Follows a SQL text (:meth:`feed`) and reports names out of scope (:meth:`errors`)."""

    def __init__(self, schema: Schema, _names: tuple[dict, set] | None = None) -> None:
        self.schema = schema
        if _names is None:  # (a decoder passes its own copy: built once per query, not per step)
            table_columns = {t.name.lower(): {c.name.lower() for c in t.columns} for t in schema.tables}
            _names = table_columns, {c for cols in table_columns.values() for c in cols}
        self.table_columns, self.all_columns = _names
        self.reset()

    def reset(self) -> None:
        self.frames: list[Frame] = [Frame(0)]
        self.closed: list[ScopeError] = []  # errors of sub-queries already closed
        self.depth = 0
        self._expect = "expr"  # what the next identifier is: expr | table | table_alias | select_alias | member
        self._qualifier: str | None = None
        self._pending: tuple[str, str] | None = None  # an identifier that a following "(" or "." may reclassify
        self._after_open = False  # the last lexeme was "(" (a "SELECT" next opens a sub-query)
        self._operand_end = False  # the last lexeme ended an operand (a name, a literal, a ")")
        self._last_table: str | None = None  # the table an "AS alias" binds
        self._last_binding: str | None = None  # the name that table was bound under (its own, or #derived..)

    # -- feeding ----------------------------------------------------------------------------------
    def feed(self, text: str) -> None:
        """Follow ``text``, a complete query (incremental use: see :meth:`frame_errors`)."""
        for m in _LEXEME.finditer(text):
            kind = m.lastgroup
            if kind != "ws":
                self._lexeme(kind, m.group())
        self._flush(None)

    def _lexeme(self, kind: str, text: str) -> None:
        if self._pending is not None:
            self._flush(text)
        after_open, self._after_open = self._after_open, text == "("
        operand_end, self._operand_end = self._operand_end, (kind in ("qid", "num", "str") or text == ")")
        frame = self.frames[-1]
        if kind == "id":
            self._operand_end = text.lower() not in _KEYWORDS
            if operand_end and self._glued_alias(text.lower(), frame):
                return
            word = text.lower()
            if word in _KEYWORDS:
                self._keyword(word, frame, after_open)
            else:
                self._identifier(text, frame)
        elif kind == "qid":
            name = _unquote(text)
            if text[0] == '"' and self._expect == "expr":
                pass  # a column if one in scope has the name, else a string (SQLite): never out of scope
            else:
                self._identifier(name, frame)
        elif text == "(":
            self.depth += 1
        elif text == ")":
            derived = False
            if len(self.frames) > 1 and self.depth == frame.depth:
                self._close_frame()
                outer = self.frames[-1]
                derived = outer.clause == "from" and self.depth - 1 == outer.depth
                if derived:  # FROM (query): its columns are not checked; an alias may bind it
                    self._last_binding = f"#derived{len(outer.tables)}"
                    outer.tables[self._last_binding] = self._last_table = None
                    outer.refs += 1
            self.depth -= 1
            self._expect = "table_alias_maybe" if derived else "expr"
        elif text == ",":
            if frame.clause in ("from", "on") and self.depth == frame.depth:
                frame.clause, self._expect = "from", "table"
            else:
                self._expect = "expr"
        elif text == ".":
            pass  # a qualifier's dot is taken with the identifier before it (_flush)
        else:
            self._expect = "expr"

    def _keyword(self, word: str, frame: Frame, after_open: bool) -> None:
        if word == "select":
            if after_open:
                self.frames.append(Frame(self.depth))
            elif frame.compound:  # the next core of a set operation
                frame.tables.clear()
                frame.refs = 0
            self.frames[-1].clause = "select"
            self._expect = "expr"
            return
        if self.depth != frame.depth:  # inside parentheses of this frame (an IN list, a function call)
            self._expect = "expr"
            return
        if word in ("from", "join"):
            frame.clause, self._expect = "from", "table"
        elif word == "as":
            self._expect = "table_alias" if frame.clause == "from" else "select_alias"
        elif word in ("on", "using"):  # a join condition: still the FROM clause, its names in scope so far
            frame.clause, self._expect = "on", "expr"
        elif word in _CLAUSE_OF:
            frame.clause, self._expect = _CLAUSE_OF[word], "expr"
        elif word in _COMPOUND:
            frame.finished += self._core_errors(frame)
            frame.columns, frame.qualified, frame.compound = [], [], True
            frame.clause, self._expect = "compound", "expr"
        elif word not in ("by", "all", "distinct", "natural", "left", "right", "inner", "outer", "cross", "full"):
            self._expect = "expr"

    def _glued_alias(self, low: str, frame: Frame) -> bool:
        """Bind ``ASname`` right after a table or a select item: the grammar reads it as ``AS name``
        (nothing forces a space after a keyword), SQLite as the alias ``ASname``; both names bind."""
        if not (low.startswith("as") and len(low) > 2 and self.depth == frame.depth):
            return False
        if frame.clause == "from" and self._expect == "table_alias_maybe":
            for alias in (low, low[2:]):
                frame.tables[alias] = self._last_table
        elif frame.clause == "select" and self._expect == "expr":
            frame.aliases |= {low, low[2:]}
        else:
            return False
        self._expect = "expr"
        return True

    def _identifier(self, name: str, frame: Frame) -> None:
        low = name.lower()
        expect = self._expect
        if expect == "table":
            self._last_table = low if low in self.table_columns else None
            frame.tables[low] = self._last_table
            self._last_binding = low
            frame.refs += 1
            self._expect = "table_alias_maybe"
        elif expect == "table_alias":
            frame.tables[low] = self._last_table
            self._expect = "expr"
        elif expect == "select_alias":
            frame.aliases.add(low)
            self._expect = "expr"
        elif expect == "member":
            self._column(frame, self._qualifier, low, name)
            self._expect, self._qualifier = "expr", None
        else:  # an expression: a column, unless "(" follows (a function) or "." follows (a qualifier)
            self._pending = (name, low)

    def _flush(self, following: str | None) -> None:
        """Classify the pending expression identifier by the lexeme after it."""
        name, low = self._pending or (None, None)
        self._pending = None
        if name is None:
            return
        frame = self.frames[-1]
        if following == "(" and low in _CALLABLE | {"cast"}:
            return
        if following == ".":
            self._expect, self._qualifier = "member", low
            return
        if low in CAST_TYPES and self.frames[-1].clause != "from" and low not in self.all_columns:
            return
        self._column(frame, None, low, name)

    def _column(self, frame: Frame, qualifier: str | None, low: str, name: str) -> None:
        if qualifier is None:
            frame.columns.append((low, frame.clause))
        else:
            frame.qualified.append((qualifier, low))

    def copy(self) -> ScopeState:
        """An independent copy (frames and their containers copied; the schema's names shared)."""
        new = object.__new__(ScopeState)
        new.__dict__.update(self.__dict__)
        new.frames = [
            replace(
                f,
                tables=dict(f.tables),
                columns=list(f.columns),
                qualified=list(f.qualified),
                aliases=set(f.aliases),
                finished=list(f.finished),
            )
            for f in self.frames
        ]
        new.closed = list(self.closed)
        return new

    # -- scope ------------------------------------------------------------------------------------
    def _binding(self, qualifier: str, upto: int) -> tuple[bool, str | None]:
        """Whether ``qualifier`` is bound in the frames up to ``upto`` (innermost first), and its table."""
        for frame in reversed(self.frames[: upto + 1]):
            if qualifier in frame.tables:
                return True, frame.tables[qualifier]
        return False, None

    def _provided(self, column: str, upto: int, local: bool = False) -> bool:
        """Whether frame ``upto`` (or, unless ``local``, a frame around it) provides ``column``."""
        for i in range(upto, upto - 1 if local else -1, -1):
            frame = self.frames[i]
            if column in frame.aliases:
                return True
            for table in frame.tables.values():
                if table is None or column in self.table_columns.get(table, ()):
                    return True
        return False

    def _unprovided(self, frame: Frame, upto: int):
        """The names ``frame`` (at ``upto``) references that its scope does not provide, as
        ``(qualifier, column, bound)``: qualifier None for an unqualified column; ``bound`` for a
        qualifier that is bound, to a table without the column."""
        for column, clause in frame.columns:  # GROUP BY / ORDER BY see the sub-query's own tables only (SQLite)
            if column not in frame.aliases and not self._provided(column, upto, clause in ("group", "order")):
                yield None, column, False
        for qualifier, column in frame.qualified:
            bound, table = self._binding(qualifier, upto)
            if not bound or (table is not None and column not in self.table_columns.get(table, ())):
                yield qualifier, column, bound

    def _core_errors(self, frame: Frame) -> list[ScopeError]:
        if frame.compound and frame.clause == "order":
            return []
        return [
            ScopeError("no such column", column if q is None else f"{q}.{column}")
            for q, column, _ in self._unprovided(frame, self.frames.index(frame))
        ]

    def frame_errors(self) -> list[ScopeError]:
        """Names the innermost open (sub-)query references that its scope does not provide (so far)."""
        self._flush(None)
        frame = self.frames[-1]
        return [*frame.finished, *self._core_errors(frame)]

    def missing(self) -> tuple[set[str], dict[str, set[str]], bool]:
        """What the innermost open frame still needs from tables it has not joined yet.

        ``(columns, qualified, dead)``: the unqualified columns no table in scope provides, the
        columns named through each qualifier not bound yet, and whether some error can no longer be
        mended by a JOIN (a bound qualifier whose table lacks the column, or an earlier core of a
        compound that was out of scope).
        """
        self._flush(None)
        frame = self.frames[-1]
        columns: set[str] = set()
        qualified: dict[str, set[str]] = {}
        dead = bool(frame.finished)
        for qualifier, column, bound in self._unprovided(frame, len(self.frames) - 1):
            if qualifier is None:
                columns.add(column)
            elif not bound:
                qualified.setdefault(qualifier, set()).add(column)
            else:
                dead = True
        return columns, qualified, dead

    def _close_frame(self) -> None:
        self.closed += self.frame_errors()
        self.frames.pop()

    def errors(self) -> list[ScopeError]:
        """Every name out of scope in the text fed so far, closing the frames still open."""
        out = list(self.closed)
        for _ in range(len(self.frames)):
            out += self.frame_errors()
            if len(self.frames) == 1:
                break
            self.frames.pop()
        return out


def scope_errors(sql: str, schema: Schema) -> list[ScopeError]:
    """The names of a complete query that its scopes do not provide (empty: in scope)."""
    state = ScopeState(schema)
    state.feed(sql)
    return state.errors()


# -- scope-aware decoding -------------------------------------------------------------------------
_IDENT_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")
_PARTIAL = re.compile(r"[A-Za-z_][A-Za-z0-9_]*$")
_ALIAS_NEXT = re.compile(r"(?i)(?:^|[^A-Za-z0-9_])as\s+$")  # the text before an alias
_RUN = re.compile(r"[A-Za-z0-9_]+")
_EXITS = frozenset(("where", "group", "order", "limit", "union", "intersect", "except"))
_WORDS = frozenset((*_KEYWORDS, *_CALLABLE, *CAST_TYPES))


def _prefixes(words) -> frozenset[str]:
    return frozenset(w[:i] for w in words for i in range(1, len(w) + 1))


class _Vocab:
    """Each token's identifier runs, indexed for the scope masks (built once per tokenizer).

    ``new`` / ``cont``: a token read as a new lexeme (leading whitespace skipped; its first run
    starts with a letter or ``_``) / as going on with an identifier (it starts with a run): its
    first run, lower-cased, to token ids, split by whether the run ends inside the token
    (``"T"``, terminated) or at its end (``"O"``, open).
    """

    def __init__(self, ll_tok: llguidance.LLTokenizer) -> None:
        n = ll_tok.vocab_size
        self.texts = [ll_tok.decode_bytes([i]).decode("utf-8", "replace") for i in range(n)]
        self.word_start = np.zeros(n, bool)  # a new lexeme that is a word
        self.cont_start = np.zeros(n, bool)  # starts with an identifier character
        self.semicolon = np.zeros(n, bool)
        self.close = np.zeros(n, bool)  # holds a ")" before any "(" (ends one level)
        self.exit_word = np.zeros(n, bool)  # a complete run after the first is an exit keyword
        self.exit_first = np.zeros(n, bool)  # ... or the first run is (read as a new lexeme)
        self.dot_start = np.zeros(n, bool)  # "." and a run: a qualified column's dot and name
        self.paren_start = np.zeros(n, bool)  # "(" after optional whitespace: a call's parenthesis
        self.dot_quote = np.zeros(n, bool)  # "." then a quote: a qualifier's dot and a quoted name
        self.quote_start = np.zeros(n, bool)  # a quoted name's opening quote, after optional whitespace
        self.nothing = np.zeros(n, bool)  # no token (never written to)
        dot: dict[tuple[str, str], list[int]] = {}
        new: dict[tuple[str, str], list[int]] = {}
        cont: dict[tuple[str, str], list[int]] = {}
        self.last_open: dict[str, list[int]] = {}  # the token's last run, open, lower-cased
        for i, text in enumerate(self.texts):
            runs = list(_RUN.finditer(text))
            self.semicolon[i] = ";" in text
            depth = 0
            for ch in text:
                depth += (ch == "(") - (ch == ")")
                if depth < 0:
                    self.close[i] = True
                    break
            self.paren_start[i] = text.lstrip().startswith("(")
            self.dot_quote[i] = text[:1] == "." and text[1:2] in ('"', "`", "[")
            self.quote_start[i] = text.lstrip()[:1] in ('"', "`", "[")
            if not runs:
                continue
            first = runs[0]
            if text.startswith(".") and first.start() == 1:
                self.dot_start[i] = True
                dot.setdefault(("O" if first.end() == len(text) else "T", first.group().lower()), []).append(i)
            low = first.group().lower()
            end = "O" if first.end() == len(text) else "T"
            if first.start() == 0:
                self.cont_start[i] = True
                cont.setdefault((end, low), []).append(i)
            if not text[: first.start()].strip() and not low[0].isdigit():
                self.word_start[i] = True
                new.setdefault((end, low), []).append(i)
                self.exit_first[i] = end == "T" and low in _EXITS
            self.exit_word[i] = any(r.group().lower() in _EXITS and r.end() < len(text) for r in runs[1:])
            if runs[-1].end() == len(text):
                self.last_open.setdefault(runs[-1].group().lower(), []).append(i)
        self.new = {k: np.asarray(v) for k, v in new.items()}
        self.cont = {k: np.asarray(v) for k, v in cont.items()}
        self.dot = {k: np.asarray(v) for k, v in dot.items()}
        self.last_open_ids = {k: np.asarray(v) for k, v in self.last_open.items()}


def _mark(out: np.ndarray, index: dict, ended, going_on) -> np.ndarray:
    """Set ``out`` at the tokens of ``index`` (a :class:`_Vocab` run index) whose first run is one of
    ``ended`` (ending inside the token) or of ``going_on`` (running to the token's end)."""
    for kind, runs in (("T", ended), ("O", going_on)):
        for run in runs:
            if (ids := index.get((kind, run))) is not None:
                out[ids] = True
    return out


def _join_distances(schema: Schema) -> dict[str, dict[str, int]]:
    """Hops between tables over declared foreign keys (either direction), reachable pairs only."""
    tables = {t.name.lower() for t in schema.tables}
    links: dict[str, set[str]] = {t: set() for t in tables}
    for t in schema.tables:
        for fk in t.foreign_keys:
            a, b = t.name.lower(), fk.ref_table.lower()
            if b in tables and a != b:
                links[a].add(b)
                links[b].add(a)
    out = {}
    for start in tables:
        seen, queue = {start: 0}, deque([start])
        while queue:
            t = queue.popleft()
            for n in links[t]:
                if n not in seen:
                    seen[n] = seen[t] + 1
                    queue.append(n)
        out[start] = seen
    return out


@dataclass(frozen=True)
class _SchemaFacts:
    """What the scope masks need of a schema, derived once per schema (not per request)."""

    names: tuple[dict, set]  # ScopeState's (table -> columns, all columns)
    columns: dict[str, frozenset[str]]  # table -> its columns (lower-cased)
    exit_only: frozenset[str]  # prefixes that can only grow into a FROM clause's exit keyword
    dist: dict[str, dict[str, int]]  # foreign-key hops between tables (_join_distances)
    bare: frozenset[str]  # tables none of whose columns needs quotes
    cap: int  # table references after which a FROM clause may end anyway
    words: frozenset[str]  # keywords, functions, types and the schema's names (lower-cased)


@lru_cache(maxsize=32)
def _schema_facts(schema: Schema) -> _SchemaFacts:
    probe = ScopeState(schema)
    names = frozenset((*probe.all_columns, *probe.table_columns))
    # what a FROM clause may go on with (no aggregate there: GROUP would pass as GROUP_CONCAT's
    # start; no EXISTS, which cannot follow a table or an operand: ' EX' would pass as its start
    # and leave the grammar nothing but EXCEPT, seen on the real model)
    going_on = (_KEYWORDS - _EXITS - {"exists"}) | frozenset(FUNCTIONS) | frozenset(CAST_TYPES) | names
    non_exit = _prefixes(going_on)
    columns = {t: frozenset(c) for t, c in probe.table_columns.items()}
    return _SchemaFacts(
        names=(probe.table_columns, probe.all_columns),
        columns=columns,
        exit_only=frozenset(p for p in _prefixes(_EXITS) if p not in non_exit),
        dist=_join_distances(schema),
        bare=frozenset(t.name.lower() for t in schema.tables if all(is_bare_identifier(c.name) for c in t.columns)),
        cap=len(columns) + 2,
        words=_WORDS | names,
    )


_MEMOS: dict = {}


def _shared_memo(key: tuple) -> dict:
    """The packed-mask memo of one (tokenizer classes, schema, EOS ids, vocabulary size); the 16 latest."""
    memo = _MEMOS.pop(key, None)
    if memo is None:
        memo = {}
        while len(_MEMOS) >= 16:
            _MEMOS.pop(next(iter(_MEMOS)))
    _MEMOS[key] = memo  # most recent last
    return memo


@lru_cache(maxsize=4)
def _vocab(ll_tok: llguidance.LLTokenizer) -> _Vocab:
    return _Vocab(ll_tok)


class ScopedConstraint(Constraint):
    """The SQL grammar's constraint, and the scope of the query written so far (issue 28).

    On top of the grammar's mask (AND) it removes the tokens that would

    * end a select list that names columns without a FROM clause, or end a FROM clause (``WHERE``,
      ``GROUP``, ``ORDER``, ``LIMIT``, a set operation, the ``)`` of a sub-query, ``;``, EOS) while
      a JOIN can still provide a column or a qualifier the (sub-)query names (:meth:`ScopeState.missing`);
      meanwhile the next table is one that provides some, or lies on a foreign-key path toward one;
    * bind an alias that is taken, or whose table lacks a column named through it;
    * write, in an ON condition or after the FROM clause, a column no table in scope has (a
      sub-query's GROUP BY / ORDER BY: its own tables); after ``T.``, a column ``T``'s table lacks
      (``T`` not bound yet: a column that no one table has together with those named through ``T``);
    * glue a word to a keyword (``WHEREname``, ``ORDERBY``, ``LIMIT10``: :meth:`_glue_rests`).

    A FROM clause may end anyway once nothing can mend it or it holds #tables + 2 references.
    The masks are numpy operations over token classes precomputed per tokenizer (:class:`_Vocab`),
    packed into bitmask words and memoised per database. If the scope would leave no token at all,
    the grammar's mask stands (``fallbacks`` counts it). ``seconds`` sums the time the scope masks took.
    """

    def __init__(self, ll_tok: llguidance.LLTokenizer, lark: str, schema: Schema, eos_ids: list[int]) -> None:
        super().__init__(ll_tok, lark)
        self.schema = schema
        self._v = _vocab(ll_tok)
        self._eos = [i for i in eos_ids if i < self.vocab_size]
        self._pieces: list[str] = []
        self.text = ""
        facts = _schema_facts(schema)
        self._names, self._columns, self._exit_only = facts.names, facts.columns, facts.exit_only
        self._dist, self._bare, self._cap = facts.dist, facts.bare, facts.cap
        self._words = facts.words
        self._states: dict[str, tuple[ScopeState, bool]] = {}  # text (right-stripped) -> its state
        self._checkpoint: tuple[str, str, ScopeState] | None = None  # see _feed
        self._rule_memo: dict[str, list[tuple]] = {}
        # (rule or dot table, partial) -> packed forbidden tokens; shared by the queries on one
        # database (the masks depend on the schema, the tokenizer and the EOS ids only)
        self._packed_memo: dict = _shared_memo((self._v, schema, tuple(self._eos), self.vocab_size))
        self._good: dict = {}  # (legal words) -> tokens a new lexeme may be
        self.seconds = 0.0
        self.fallbacks = 0

    def consume(self, token: int) -> None:
        super().consume(token)
        piece = "" if token in self._eos else self._v.texts[token]
        self._pieces.append(piece)
        self.text += piece

    def rollback(self, n: int) -> None:
        super().rollback(n)
        for _ in range(n):
            piece = self._pieces.pop()
            self.text = self.text[: len(self.text) - len(piece)]

    def mask(self, bitmask: torch.Tensor, row: int) -> None:
        super().mask(bitmask, row)
        t0 = time.perf_counter()
        try:
            self._scope_mask(bitmask, row)
        finally:
            self.seconds += time.perf_counter() - t0

    # -- the rules --------------------------------------------------------------------------------
    def _state(self, head: str) -> tuple[ScopeState, bool]:
        """The scope state after ``head`` and whether ``head`` ends inside a literal (memoised: the
        next step's text without its last identifier is mostly this step's text)."""
        key = head.rstrip()  # trailing whitespace changes nothing (inside a literal: still inside)
        hit = self._states.get(key)
        if hit is None:
            hit = self._feed(key)
            if len(self._states) >= 4:
                self._states.pop(next(iter(self._states)))
            self._states[key] = hit
        return hit

    def _feed(self, key: str) -> tuple[ScopeState, bool]:
        """Feed ``key`` from the checkpoint of an earlier text when it goes on from there: the state
        before that text's last lexeme (the only one that more text can change), kept with the text
        before it and the lexeme's first character (the same character: the lexemes before end the
        same way)."""
        start, state = 0, None
        if self._checkpoint is not None:
            prefix, first, snap = self._checkpoint
            if key.startswith(prefix) and key[len(prefix) : len(prefix) + 1] == first:
                start, state = len(prefix), snap
        if state is None:
            state = ScopeState(self.schema, self._names)
        lexemes = [m for m in _LEXEME.finditer(key, start) if m.lastgroup != "ws"]
        last = lexemes[-1] if lexemes else None
        if last is not None and last.start() == start and start and state is self._checkpoint[2]:
            state = state.copy()  # only the last lexeme changed: the checkpoint stays
        else:  # the checkpoint moves to before this text's last lexeme (one copy either way)
            for m in lexemes[:-1]:
                state._lexeme(m.lastgroup, m.group())
            if last is not None:
                self._checkpoint = key[: last.start()], key[last.start()], state
                state = state.copy()
        if last is not None:
            state._lexeme(last.lastgroup, last.group())
        state._flush(None)
        return state, _open_literal(last)

    def _rules(self, head: str) -> list[tuple]:
        """What a token after ``head`` may write, as rules that all hold: ("words", legal words,
        words that may end here) | ("columns", ..., ...: words, and no quoted name) | ("avoid",
        names, None) | ("exit", closing levels, None: the FROM clause may not end)."""
        key = head.rstrip()
        rules = self._rule_memo.get(key)
        if rules is None:
            rules = self._rule_memo[key] = self._make_rules(key)
            if len(self._rule_memo) > 4:
                self._rule_memo.pop(next(iter(self._rule_memo)))
        return rules

    def _make_rules(self, head: str) -> list[tuple]:
        state, in_literal = self._state(head)
        if in_literal:
            return []
        frame = state.frames[-1]
        upto = len(state.frames) - 1
        rules = []
        if state._expect == "member":
            member = self._member_words(state, state._qualifier)
            if member is None:
                return []
            cols, quoted = member
            return [("words" if quoted else "columns", cols, cols)]
        if state._expect == "table" and frame.clause == "from" and state.depth == frame.depth:
            legal = self._tables_toward(state, frame)
            return [("words", legal, legal)] if legal is not None else []
        if state._expect == "table_alias":
            taken = {b for b in frame.tables if b != state._last_binding}
            table = state._last_table
            if table is not None and frame.refs > len(self._columns):
                # mending (more table references than the schema has tables, something still
                # missing): a qualifier named so far whose columns this table has is bound here
                serves = {q for q, needed in state.missing()[1].items() if needed <= self._columns[table]} - taken
                if serves:
                    return [("words", frozenset(serves), frozenset(serves))]
            lacking = {q for q, c in frame.qualified if table is not None and c not in self._columns[table]}
            return [("avoid", frozenset(taken | lacking), None)] if taken | lacking else []
        if frame.clause in ("on", "where", "group", "having", "order") and state._expect == "expr":
            rules += self._in_scope(state, frame)
        # a FROM clause (or a select list without one) cannot end while a JOIN (a FROM) can still mend it
        if frame.clause in ("select", "from", "on") and self._mendable(state, frame) is not None:
            rules.append(("exit", (state.depth - frame.depth + 1 if upto else None), None))
        return rules

    def _in_scope(self, state: ScopeState, frame: Frame) -> list[tuple]:
        """An expression's words: the columns, bindings and select aliases in scope, and keywords."""
        if frame.compound and frame.clause == "order":
            return []
        frames = state.frames[-1:] if frame.clause in ("group", "order") else state.frames
        if any(table is None for f in frames for table in f.tables.values()):
            return []  # a derived table: its columns are not known here
        columns = {c for f in frames for table in f.tables.values() for c in self._columns[table]}
        bindings = {b for f in state.frames for b in f.tables}
        aliases = {a for f in frames for a in f.aliases}
        plain = frozenset(columns | bindings | aliases | _KEYWORDS | frozenset(CAST_TYPES))
        return [("words", frozenset(plain | _CALLABLE), plain)]

    def _member_words(self, state: ScopeState, qualifier: str) -> tuple[frozenset[str], bool] | None:
        """The columns ``qualifier.`` may name, and whether a quoted one may be written (some column
        needs quotes); None: no restriction (a derived table, or nothing known yet)."""
        bound, table = state._binding(qualifier, len(state.frames) - 1)
        if bound:
            return None if table is None else (self._columns[table], table not in self._bare)
        # not bound yet (a select list): a column that some table has beside those named so far
        needed = {c for q, c in state.frames[-1].qualified if q == qualifier}
        cols = frozenset(c for tc in self._columns.values() if needed <= tc for c in tc) if needed else None
        return (cols, True) if cols else None

    def _mendable(self, state: ScopeState, frame: Frame) -> set[str] | None:
        """The tables that would each provide some of what the frame still needs; None: nothing a
        JOIN can mend (nothing missing, an error no JOIN can fix, or the FROM clause too long already)."""
        columns, qualified, dead = state.missing()
        if dead or not (columns or qualified) or frame.refs >= self._cap:
            return None
        targets = {t for t, cols in self._columns.items() if columns & cols}
        for needed in qualified.values():
            holders = {t for t, cols in self._columns.items() if needed <= cols}
            if not holders:
                return None  # no table has all the columns named through this qualifier
            targets |= holders
        return targets or None

    def _tables_toward(self, state: ScopeState, frame: Frame) -> frozenset[str] | None:
        """The tables a FROM clause that still needs columns may name next: those that provide some,
        those on a shortest foreign-key path from a table already joined to one that does, and the
        joined tables' foreign-key neighbours (a join that a later WHERE filters on); the first
        table: any table with a path to one that provides some; once the clause has as many table
        references as the schema has tables (mending), only those that provide some. None: no
        restriction."""
        targets = self._mendable(state, frame)
        if targets is None:
            return None
        dist = self._dist
        if frame.refs >= len(self._columns):  # mending: only a table that provides what is missing
            return frozenset(targets)
        joined = {t for t in frame.tables.values() if t is not None}
        if not joined:
            return frozenset(t for t in dist if any(g in dist[t] for g in targets))
        legal = set(targets) | {t for c in joined for t, d in dist[c].items() if d == 1}
        for c in joined:
            for g in targets:
                if (dcg := dist[c].get(g)) is not None:
                    legal |= {t for t, dct in dist[c].items() if dct + dist[t].get(g, dcg + 1) == dcg}
        return frozenset(legal)

    def _new_good(self, words: frozenset[str]) -> np.ndarray:
        """Tokens that, as a new lexeme, start one of ``words`` (or are no word at all)."""
        good = self._good.get(words)
        if good is None:
            v = self._v
            good = _mark(~v.word_start, v.new, words, _prefixes(words))
            if len(self._good) > 64:
                self._good.clear()
            self._good[words] = good
        return good

    def _bad(self, partial: str) -> np.ndarray | None:
        """Tokens the scope forbids next, packed as the grammar's bitmask words; None: none."""
        head = self.text[: len(self.text) - len(partial)]
        cont = self._v.cont_start if partial else self._v.nothing
        parts = [
            self._packed(("new", rule, bool(partial)), lambda r=rule: self._new_bad(r) & ~cont)
            for rule in self._rules(self.text)
        ]
        if partial and not head[-1:].isdigit():  # (inside a number such as 1e5: no identifier)
            for rule in self._rules(head):
                parts.append(self._packed(("go", rule, partial), lambda r=rule: self._going_on_bad(r, partial, cont)))
        if partial:  # a token with the dot and the column after a qualifier: the column of its table
            member = self._qualified_member(head, partial.lower())
            if member is not None:
                parts.append(self._packed(("dot", *member), lambda: self._dot_bad(*member)))
        if (rests := self._glue_rests(head, partial)) is not None:
            parts.append(self._packed(("glue", partial.lower(), rests), lambda: self._glue_bad(rests)))
        if not parts:
            return None
        return np.bitwise_or.reduce(parts) if len(parts) > 1 else parts[0]

    def _glue_rests(self, head: str, partial: str) -> frozenset[str] | None:
        """After a keyword written as a whole word, the ways a token may go on with it (None: any).

        The grammar ignores whitespace between lexemes, so ``WHERE`` followed by ``name`` lexes as
        two lexemes and ``WHEREname`` passes, as do ``ORDERBY`` and ``LIMIT10`` (SQLite rejects them;
        seen on compressed caches). Going on with a keyword's run is kept for the words it starts:
        longer keywords (``OR`` -> ``ORDER``), function and type names, the schema's names and the
        identifiers written so far (an alias such as ``order_cnt``). Not after ``AS`` (an alias is
        being written, any identifier), after ``.`` (a column) or inside a literal.
        """
        low = partial.lower()
        if low not in _KEYWORDS or head[-1:].isalnum() or head[-1:] in ("_", ".") or _ALIAS_NEXT.search(head):
            return None
        if self._state(head)[1]:
            return None
        words = self._words | {w.lower() for w in _RUN.findall(head)}
        return frozenset(w[len(low) :] for w in words if w.startswith(low) and len(w) > len(low))

    def _glue_bad(self, rests: frozenset[str]) -> np.ndarray:
        """Tokens that go on with the keyword's run other than into one of ``rests``."""
        v = self._v
        return v.cont_start & ~_mark(np.zeros_like(v.cont_start), v.cont, rests, _prefixes(rests))

    def _packed(self, key: tuple, make) -> np.ndarray:
        """``make()`` (a boolean mask over the vocabulary) packed into bitmask words, memoised by ``key``."""
        out = self._packed_memo.get(key)
        if out is None:
            bits = np.packbits(make()[: self.vocab_size], bitorder="little")
            out = np.zeros(((self.vocab_size + 31) // 32) * 4, np.uint8)
            out[: bits.size] = bits
            out = out.view(np.uint32)
            if len(self._packed_memo) > 2048:
                self._packed_memo.clear()
            self._packed_memo[key] = out
        return out

    def _dot_bad(self, words: frozenset[str], quoted: bool) -> np.ndarray:
        """Tokens with a qualifier's dot and a column not among ``words`` (or, unless ``quoted``, a quote)."""
        v = self._v
        bad = v.dot_start & ~_mark(np.zeros_like(v.dot_start), v.dot, words, _prefixes(words))
        return bad if quoted else bad | v.dot_quote

    def _new_bad(self, rule: tuple) -> np.ndarray:
        """The tokens ``rule`` forbids as a new lexeme (after a complete word, or no word)."""
        v = self._v
        kind, arg, _ = rule
        if kind in ("words", "columns"):
            b = ~self._new_good(arg)
            return b | v.quote_start if kind == "columns" else b  # T. then a quoted name T's table lacks
        if kind == "avoid":  # an alias: any name but these (a token ending on one: the alias itself)
            return _mark(np.zeros_like(v.cont_start), v.new, arg, arg)
        b = v.semicolon | v.exit_word | v.exit_first
        if arg == 1:
            b = b | v.close
        elif arg is not None:
            b = b | self._closes(arg)
        for p in self._exit_only:
            if (ids := v.last_open_ids.get(p)) is not None:
                b[ids] = True
        b = b.copy()
        b[self._eos] = True
        return b

    def _going_on_bad(self, rule: tuple, partial: str, cont: np.ndarray) -> np.ndarray:
        """The tokens ``rule`` forbids after the identifier ``partial`` at the end of the text."""
        v = self._v
        kind, arg, plain = rule
        low = partial.lower()
        if kind == "avoid":
            rests = [w[len(low) :] for w in arg if w.startswith(low) and len(w) > len(low)]
            b = cont & _mark(np.zeros_like(cont), v.cont, rests, rests)
            if low in arg:  # the alias written so far is taken: it may only go on
                b = b | ~cont
                b[self._eos] = True
            return b
        if kind in ("words", "columns"):
            rests = [w[len(low) :] for w in arg if w.startswith(low) and len(w) > len(low)]
            b = cont & ~_mark(np.zeros_like(cont), v.cont, rests, _prefixes(rests))
            ended = None  # the identifier, ended by the next token, must be a word of this place
            if low in _CALLABLE and low not in plain:
                ended = ~cont & ~v.paren_start  # a function's name: its "(" comes next
            elif low not in plain:
                ended = ~cont
            if ended is not None:
                b = b | ended
                b[self._eos] = True
            return b
        b = cont & (v.semicolon | v.exit_word | (v.close if arg == 1 else False))
        if any(e.startswith(low) for e in _EXITS):
            b = b | (cont & self._cont_exits(partial))
        if low in _EXITS:  # the word is an exit keyword already: only going on may pass
            b = b | ~cont
            b[self._eos] = True
        return b

    def _qualified_member(self, head: str, qualifier: str) -> tuple[frozenset[str], bool] | None:
        """What a token carrying the dot and a column may name after ``head`` + ``qualifier``
        (:meth:`_member_words`; None: no restriction, or not an expression's identifier)."""
        state, in_literal = self._state(head)
        if in_literal or state._expect not in ("expr",):
            return None
        return self._member_words(state, qualifier)

    def _closes(self, levels: int) -> np.ndarray:
        v = self._v
        out = np.zeros_like(v.close)
        for i in np.flatnonzero(v.close):
            depth = 0
            for ch in v.texts[i]:
                depth += (ch == "(") - (ch == ")")
                if -depth >= levels:
                    out[i] = True
                    break
        return out

    def _cont_exits(self, partial: str) -> np.ndarray:
        """Continuation tokens whose first run completes ``partial`` into an exit keyword, or only toward one."""
        v, low = self._v, partial.lower()
        rests = [e[len(low) :] for e in _EXITS if e.startswith(low) and len(e) > len(low)]
        toward = [p for p in _prefixes(rests) if low + p in self._exit_only]
        return _mark(np.zeros_like(v.cont_start), v.cont, rests, toward)

    def _scope_mask(self, bitmask: torch.Tensor, row: int) -> None:
        m = _PARTIAL.search(self.text)
        bad = self._bad(m.group() if m else "")
        if bad is None:
            return
        words = bitmask[row].numpy().view(np.uint32)
        keep = words[: bad.size] & ~bad
        if np.array_equal(keep, words[: bad.size]):
            return
        if not keep.any():
            self.fallbacks += 1
            return
        words[: bad.size] = keep
