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
from dataclasses import dataclass, field
from functools import lru_cache

import llguidance
import numpy as np
import torch

from pask.structure.constraint import Constraint
from pask.structure.sql_grammar import AGGREGATES, CAST_TYPES, FUNCTIONS, KEYWORDS
from pask.structure.sql_schema import Schema

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


def _unquote(text: str) -> str:
    if text[:1] in '"`' and len(text) >= 2 and text[-1] == text[0]:
        return text[1:-1].replace(text[0] * 2, text[0])
    if text[:1] == "[" and text.endswith("]"):
        return text[1:-1]
    return text


class ScopeState:
    """Follows a SQL text (:meth:`feed`) and reports names out of scope (:meth:`errors`)."""

    def __init__(self, schema: Schema) -> None:
        self.schema = schema
        self.table_columns = {t.name.lower(): {c.name.lower() for c in t.columns} for t in schema.tables}
        self.all_columns = {c for cols in self.table_columns.values() for c in cols}
        self.reset()

    def reset(self) -> None:
        self.frames: list[Frame] = [Frame(0)]
        self.closed: list[ScopeError] = []  # errors of sub-queries already closed
        self.depth = 0
        self._expect = "expr"  # what the next identifier is: expr | table | table_alias | select_alias | member
        self._qualifier: str | None = None
        self._pending: tuple[str, str] | None = None  # an identifier that a following "(" or "." may reclassify
        self._after_open = False  # the last lexeme was "(" (a "SELECT" next opens a sub-query)
        self._last_table: str | None = None  # the table an "AS alias" binds

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
        frame = self.frames[-1]
        if kind == "id":
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
                    outer.tables[f"#derived{len(outer.tables)}"] = self._last_table = None
            self.depth -= 1
            self._expect = "table_alias_maybe" if derived else "expr"
        elif text == ",":
            self._expect = "table" if frame.clause == "from" and self.depth == frame.depth else "expr"
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
        elif word in ("on", "using"):
            self._expect = "expr"
        elif word in _CLAUSE_OF:
            frame.clause, self._expect = _CLAUSE_OF[word], "expr"
        elif word in _COMPOUND:
            frame.finished += self._core_errors(frame)
            frame.columns, frame.qualified, frame.compound = [], [], True
            frame.clause, self._expect = "compound", "expr"
        elif word not in ("by", "all", "distinct", "natural", "left", "right", "inner", "outer", "cross", "full"):
            self._expect = "expr"

    def _identifier(self, name: str, frame: Frame) -> None:
        low = name.lower()
        expect = self._expect
        if expect == "table":
            self._last_table = low if low in self.table_columns else None
            frame.tables[low] = self._last_table
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

    @staticmethod
    def _in_literal(text: str) -> bool:
        """Whether ``text`` ends inside a string literal or a quoted name (an unterminated lexeme)."""
        last = None
        for m in _LEXEME.finditer(text):
            last = m
        if last is None or last.lastgroup not in ("str", "qid"):
            return False
        lexeme = last.group()
        close = {"'": "'", '"': '"', "`": "`", "[": "]"}[lexeme[0]]
        if len(lexeme) == 1 or not lexeme.endswith(close):
            return True
        return close != "]" and len(lexeme) > 2 and lexeme.endswith(close * 2)  # an escaped quote, still open

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

    def _core_errors(self, frame: Frame) -> list[ScopeError]:
        if frame.compound and frame.clause == "order":
            return []
        upto = self.frames.index(frame)
        out = []
        for column, clause in frame.columns:  # GROUP BY / ORDER BY see the sub-query's own tables only (SQLite)
            if column not in frame.aliases and not self._provided(column, upto, clause in ("group", "order")):
                out.append(ScopeError("no such column", column))
        for qualifier, column in frame.qualified:
            bound, table = self._binding(qualifier, upto)
            if not bound or (table is not None and column not in self.table_columns.get(table, ())):
                out.append(ScopeError("no such column", f"{qualifier}.{column}"))
        return out

    def frame_errors(self) -> list[ScopeError]:
        """Names the innermost open (sub-)query references that its scope does not provide (so far)."""
        self._flush(None)
        frame = self.frames[-1]
        return [*frame.finished, *self._core_errors(frame)]

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
_EXITS = frozenset(("where", "group", "order", "limit", "union", "intersect", "except"))
_WORDS = frozenset((*_KEYWORDS, *_CALLABLE, *CAST_TYPES))


def _prefixes(words) -> frozenset[str]:
    return frozenset(w[:i] for w in words for i in range(1, len(w) + 1))


@lru_cache(maxsize=8)
def _token_texts(ll_tok: llguidance.LLTokenizer) -> tuple[str, ...]:
    return tuple(ll_tok.decode_bytes([i]).decode("utf-8", "replace") for i in range(ll_tok.vocab_size))


def _word_ok(partial: str, text: str, words: frozenset[str], prefixes: frozenset[str]) -> bool:
    """Whether ``text`` after ``partial`` (the identifier being written) keeps that identifier one of
    ``words`` (complete) or on the way to one (a prefix); numbers, strings and quoted names pass."""
    w = partial
    for ch in text:
        if ch in _IDENT_CHARS:
            w += ch
            continue
        if not w and ch in " \t\r\n":
            continue
        return not w or w[0].isdigit() or w.lower() in words
    return not w or w[0].isdigit() or w.lower() in prefixes


class ScopedConstraint(Constraint):
    """The SQL grammar's constraint, and the scope of the query written so far (issue 28).

    On top of the grammar's mask (AND) it removes the tokens that would

    * end a FROM clause (``WHERE``, ``GROUP``, ``ORDER``, ``LIMIT``, a set operation, the ``)`` of a
      sub-query, ``;``, EOS) while the (sub-)query names a column that none of its tables provides
      or a qualifier it has not bound (:meth:`ScopeState.frame_errors`): the query must first JOIN
      the table that has it;
    * write, after the FROM clause (WHERE, GROUP BY, HAVING, ORDER BY), a column that no table in
      scope has (GROUP BY / ORDER BY of a sub-query: its own tables), or, after ``T.``, a column
      that ``T``'s table lacks.

    Unqualified names in the select list are free when written (the FROM clause comes after them).
    If the scope would leave no token at all, the grammar's mask stands (``fallbacks`` counts it).
    ``seconds`` sums the time the scope masks took.
    """

    def __init__(self, ll_tok: llguidance.LLTokenizer, lark: str, schema: Schema, eos_ids: list[int]) -> None:
        super().__init__(ll_tok, lark)
        self.schema = schema
        self._texts = _token_texts(ll_tok)
        self._eos = [i for i in eos_ids if i < self.vocab_size]
        self._pieces: list[str] = []
        self.text = ""
        probe = ScopeState(schema)
        self._columns = {t: frozenset(c) for t, c in probe.table_columns.items()}
        self._names = frozenset((*probe.all_columns, *probe.table_columns))
        self._non_exit = _prefixes((_WORDS - _EXITS) | self._names)
        self._cache: dict = {}
        self.seconds = 0.0
        self.fallbacks = 0

    def consume(self, token: int) -> None:
        super().consume(token)
        piece = "" if token in self._eos else self._texts[token]
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
    def _rule(self, head: str, partial: str):
        """(key, check, block_eos) for a token written after ``head`` + ``partial`` (the identifier it
        continues; empty: a token that starts a new lexeme); None: nothing to check."""
        if partial and head[-1:].isdigit():  # inside a number such as 1e5: not an identifier
            return None
        state = ScopeState(self.schema)
        state.feed(head)
        if state._in_literal(head):
            return None
        frame = state.frames[-1]
        upto = len(state.frames) - 1
        if state._expect == "member":
            bound, table = state._binding(state._qualifier, upto)
            if not bound or table is None:
                return None
            words = self._columns[table]
            return ("member", table, partial), lambda t: _word_ok(partial, t, words, _prefixes(words)), False
        if frame.clause in ("where", "group", "having", "order") and state._expect == "expr":
            if frame.compound and frame.clause == "order":
                return None
            local = frame.clause in ("group", "order")
            frames = state.frames[-1:] if local else state.frames
            if any(table is None for f in frames for table in f.tables.values()):
                return None  # a derived table: its columns are not known here
            columns = {c for f in frames for table in f.tables.values() for c in self._columns[table]}
            bindings = {b for f in state.frames for b in f.tables}
            aliases = {a for f in frames for a in f.aliases}
            words = frozenset(columns | bindings | aliases | _WORDS)
            key = ("expr", words, partial)
            return key, lambda t: _word_ok(partial, t, words, self._prefix_set(words)), False
        if frame.clause == "from" and state.frame_errors():
            closing = state.depth - frame.depth + 1 if upto else None  # the ")" that would end this sub-query
            key = ("exit", partial, closing)
            return key, lambda t: self._no_exit(partial, t, closing), True
        return None

    def _prefix_set(self, words: frozenset[str]) -> frozenset[str]:
        got = self._cache.get(("prefixes", words))
        if got is None:
            got = self._cache[("prefixes", words)] = _prefixes(words)
        return got

    def _no_exit(self, partial: str, text: str, closing: int | None) -> bool:
        w, depth = partial, 0
        for ch in text:
            if ch in _IDENT_CHARS:
                w += ch
                continue
            if w.lower() in _EXITS:
                return False
            w = ""
            if ch == ";":
                return False
            depth += (ch == "(") - (ch == ")")
            if closing is not None and -depth >= closing:
                return False
        low = w.lower()
        return not low or low[0].isdigit() or low in self._non_exit or not any(e.startswith(low) for e in _EXITS)

    def _scope_mask(self, bitmask: torch.Tensor, row: int) -> None:
        m = _PARTIAL.search(self.text)
        partial = m.group() if m else ""
        # a token that goes on with the identifier at the end of the text, and one that ends it
        going_on = self._rule(self.text[: len(self.text) - len(partial)], partial) if partial else None
        new = self._rule(self.text, "")
        if going_on is None and new is None:
            return
        words = bitmask[row].numpy().view(np.uint32)
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")[: self.vocab_size]
        allowed = np.flatnonzero(bits)
        bad = []
        for i in allowed.tolist():
            text = self._texts[i]
            rule = going_on if partial and i not in self._eos and text[:1] in _IDENT_CHARS else new
            if rule is None:
                continue
            key, check, block_eos = rule
            verdicts = self._cache.setdefault(key, {})
            ok = verdicts.get(i)
            if ok is None:
                ok = verdicts[i] = (not block_eos) if i in self._eos else check(text)
            if not ok:
                bad.append(i)
        if not bad:
            return
        if len(bad) == len(allowed):
            self.fallbacks += 1
            return
        bad_ids = np.asarray(bad, dtype=np.int64)
        np.bitwise_and.at(words, bad_ids >> 5, ~(np.uint32(1) << (bad_ids & 31).astype(np.uint32)))
