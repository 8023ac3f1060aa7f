"""Incremental tagger for generated SQL: a clause state machine over sqlglot tokens.

Feed it the text (or bytes) of every accepted token; it returns the token's
:class:`~pask.structure.tags.Tag`. The SQL prefix is tokenised with sqlglot's
SQLite tokenizer after closing an unterminated quote, bracket or comment. Only
the tail is re-tokenised each step: the last sql tokens stay provisional (``>``
may become ``>=``, ``GROUP`` may become ``GROUP BY``, ``sing`` may become
``singer``) until whitespace follows them (or two more tokens do); everything
before is committed once, with the clause state after it.

Tag components of one sql token (an LLM token combines the sql tokens it
overlaps with the priorities of :mod:`pask.structure.tags`; whitespace and
comments add nothing, a token of only whitespace gets (pure_scaffold, current
clause, stable)):

- role = the clause the token is in; a clause keyword takes the clause it opens.
  ``SELECT`` ... → projection; ``FROM`` / ``JOIN`` (and ``LEFT``, ``INNER``, ``USING`` ...)
  → relation; ``WHERE`` / ``ON`` / ``HAVING`` → predicate; ``GROUP BY``, ``ORDER BY``,
  ``LIMIT``, ``OFFSET``, set operators and anything before the first ``SELECT``
  → outside_schema. A parenthesised ``SELECT`` opens a nested query whose clauses
  end at its ``)``; other parentheses keep the clause.
- class/state: a schema identifier is (schema_bearing, critical); clause keywords,
  ``,``, ``(``, ``)`` and ``;`` are (pure_scaffold, boundary); string and number
  literals and identifiers that do not resolve are (free_generation, stable);
  everything else (operators, ``AS``, ``AND``, function names, ``*``) is
  (pure_scaffold, stable).
- An identifier (case-insensitive) is a schema identifier when it is a table, a
  column of any table or an alias in the alias map; when it qualifies (``X.``) or
  is qualified (``.x``); when it defines an alias in a relation clause
  (``FROM singer AS T1`` / ``FROM singer T1``: ``T1`` → ``singer`` from then on);
  or, being the last, still growing word (no whitespace after it yet; any word
  but a clause keyword, so ``Is`` of ``Is_male`` too), when it is a proper
  prefix of a table, column or alias name. An identifier followed by ``(`` is a function name. A
  double-quoted "identifier" that does not resolve is a string literal (SQLite).
- next = lookahead_critical when the last sql token is one after which an
  identifier is expected (``SELECT``, ``DISTINCT``, ``FROM``, ``JOIN``, ``ON``, ``WHERE``,
  ``AND``, ``OR``, ``HAVING``, ``GROUP BY``, ``ORDER BY``, ``,``, ``(``, ``.``, ``AS`` in a
  relation clause, a comparison inside ``ON``) or is a still growing proper prefix
  of a schema name; else no_lookahead.

If sqlglot cannot tokenise the text the token gets :data:`SQL_FALLBACK` and
``degraded`` is set; the tagger never raises.
"""

from __future__ import annotations

import codecs
import re

from sqlglot.dialects.sqlite import SQLite
from sqlglot.tokens import Token, TokenType

from pask.structure.tags import SQL_FALLBACK, Next, SqlRole, State, Tag, TagClass

T = TokenType
_OUT, _PROJ, _PRED, _REL = 0, 1, 2, 3  # role ranks (priority order)
_ROLES = (SqlRole.OUTSIDE_SCHEMA, SqlRole.PROJECTION, SqlRole.PREDICATE, SqlRole.RELATION)
_CLASSES = (TagClass.PURE_SCAFFOLD, TagClass.FREE_GENERATION, TagClass.SCHEMA_BEARING)
_STATES = (State.STABLE, State.BOUNDARY, State.CRITICAL)
_SCAF, _FREE, _SCHEMA = 0, 1, 2
_STABLE, _BOUNDARY, _CRITICAL = 0, 1, 2
_TAGS = {
    (c, r, s, la): Tag(_CLASSES[c], _ROLES[r], _STATES[s], Next.LOOKAHEAD_CRITICAL if la else Next.NO_LOOKAHEAD)
    for c in range(3)
    for r in range(4)
    for s in range(3)
    for la in (False, True)
}

# First words of sqlglot's two-word keywords: a token like this may still merge with the next word.
_MULTI_HEADS = frozenset(k.split()[0] for k in SQLite.Tokenizer.KEYWORDS if " " in k)
_OPENERS = re.compile(r"['\"`\[]|--|/\*")
_JOIN_WORDS = frozenset({T.JOIN, T.LEFT, T.RIGHT, T.INNER, T.OUTER, T.CROSS, T.FULL, T.NATURAL, T.USING})
_SET_OPS = frozenset({T.UNION, T.INTERSECT, T.EXCEPT})
_OUTSIDE = frozenset({T.GROUP_BY, T.ORDER_BY, T.LIMIT, T.OFFSET}) | _SET_OPS
_COMPARE = frozenset({T.EQ, T.NEQ, T.GT, T.GTE, T.LT, T.LTE})
_LA_AFTER = frozenset(
    {T.SELECT, T.DISTINCT, T.FROM, T.JOIN, T.ON, T.WHERE, T.AND, T.OR, T.HAVING, T.GROUP_BY, T.ORDER_BY}
    | {T.COMMA, T.L_PAREN, T.DOT}
)
_CLAUSE_WORDS = frozenset({T.SELECT, T.FROM, T.WHERE, T.ON, T.HAVING}) | _JOIN_WORDS | _OUTSIDE
# Token types that are never identifiers, whatever their text.
_NEVER_IDENT = (
    frozenset(
        {T.SELECT, T.FROM, T.WHERE, T.ON, T.HAVING, T.AND, T.OR, T.NOT, T.ALIAS, T.DISTINCT, T.IN, T.IS, T.LIKE}
        | {T.BETWEEN, T.CASE, T.WHEN, T.THEN, T.ELSE, T.END, T.NULL, T.EXISTS, T.ALL, T.STAR, T.STRING, T.NUMBER}
        | {T.COMMA, T.DOT, T.L_PAREN, T.R_PAREN, T.SEMICOLON}
    )
    | _JOIN_WORDS
    | _OUTSIDE
    | _COMPARE
)


class _Clauses:
    """Clause state after a sequence of sql tokens (copied for the provisional tail)."""

    __slots__ = ("after_table", "aliases", "last_table", "on", "prev", "prev_text", "stack")

    def __init__(self) -> None:
        self.stack: list[list] = [[_OUT, True]]  # [clause role rank, is a query level]
        self.aliases: dict[str, str | None] = {}
        self.prev: TokenType | None = None
        self.prev_text = ""
        self.last_table: str | None = None
        self.after_table = False  # the previous token named a table in a relation clause
        self.on = False  # the current predicate is a join condition

    def copy(self) -> _Clauses:
        c = _Clauses.__new__(_Clauses)
        c.stack = [list(f) for f in self.stack]
        c.aliases = dict(self.aliases)
        c.prev, c.prev_text = self.prev, self.prev_text
        c.last_table, c.after_table, c.on = self.last_table, self.after_table, self.on
        return c


class SqlTagger:
    """Incremental (class, role, state, next) tagger for generated SQL.

    ``schema`` maps table names to column names (case-insensitive). With
    ``incremental=False`` the whole prefix is re-tokenised and re-run each step
    (a slow reference for tests).
    """

    def __init__(self, schema: dict[str, list[str]], incremental: bool = True) -> None:
        self._tables = {t.lower() for t in schema}
        self._columns = {c.lower() for cols in schema.values() for c in cols}
        self._names = self._tables | self._columns
        self._prefixes = {n[:k] for n in self._names for k in range(1, len(n))}
        self._tok = SQLite().tokenizer_class()
        self._incremental = incremental
        self.reset()

    def reset(self) -> None:
        """Forget the text so far (start of a new response)."""
        self._text = ""
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._state = _Clauses()
        self._safe = 0  # start of the provisional tail
        self._tail: tuple[Token, _Clauses] | None = None  # last sql token and the state after it
        self._closed = True  # the text ends outside any quote or comment
        self.degraded = False

    @property
    def text(self) -> str:
        return self._text

    def step(self, token_text: str | bytes) -> Tag:
        """Consume one accepted token (text, or bytes decoded incrementally) and return its tag."""
        try:
            if isinstance(token_text, bytes | bytearray):
                token_text = self._decoder.decode(bytes(token_text))
            return self._step(token_text)
        except Exception:  # tokeniser errors and surprises degrade, never stop decoding
            self.degraded = True
            return SQL_FALLBACK

    def _step(self, new: str) -> Tag:
        a = len(self._text)
        self._text += new
        b = len(self._text)
        if not self._incremental:
            self._state, self._safe = _Clauses(), 0
        elif self._tail is not None and new.isspace():
            return self._space_step(b)
        toks = self._tokenize(self._safe)
        n = len(toks)
        # inside an unterminated quote or comment nothing is final: its end may still turn what
        # follows into text ("/*" then "x" is a comment, not an identifier)
        ncommit = self._final_count(toks, b) if self._closed else 0
        if a == b and a > self._safe:  # part of a character: it belongs to what the text ends in
            a -= 1
        state = self._state
        committed = state
        cls = role = st = -1
        for j, tok in enumerate(toks):
            if j == ncommit:
                committed, state = state, state.copy()
            nxt = toks[j + 1] if j + 1 < n else None
            c, r, s = self._feed(state, tok, nxt, growing=j == n - 1 and tok.end == b - 1)
            if tok.end >= a and tok.start < b:
                cls, role, st = max(cls, c), max(role, r), max(st, s)
        if ncommit == n:
            committed = state
        la = self._lookahead(state, toks[-1] if toks else None)
        self._state = committed
        self._safe = toks[ncommit].start if ncommit < n else (b if self._closed else self._safe)
        self._tail = (toks[-1], state) if n > 0 and self._closed else None
        if cls < 0:  # only whitespace / comment
            return _TAGS[(_SCAF, state.stack[-1][0], _STABLE, la)]
        return _TAGS[(cls, role, st, la)]

    def _space_step(self, b: int) -> Tag:
        """Whitespace after a complete token: nothing to re-tokenise; the tail becomes final."""
        last, state = self._tail
        if last.text.upper() not in _MULTI_HEADS:
            self._state, self._safe = state, b
            self._tail = None
        return _TAGS[(_SCAF, state.stack[-1][0], _STABLE, self._lookahead(state, last))]

    def _final_count(self, toks: list[Token], b: int) -> int:
        """How many leading sql tokens can no longer change: all but the last two, plus any
        followed by whitespace unless it may start a two-word keyword (``GROUP`` → ``GROUP BY``)."""
        n = len(toks)
        if n == 0:
            return 0
        last = toks[-1]
        if last.end < b - 1 and self._text[last.end + 1 : b].isspace() and last.text.upper() not in _MULTI_HEADS:
            return n
        if n >= 2:
            prev = toks[-2]
            if last.start > prev.end + 1 and prev.text.upper() not in _MULTI_HEADS:
                return n - 1
            return n - 2
        return 0

    def _tokenize(self, start: int) -> list[Token]:
        tail = self._text[start:]
        closer = _closer(tail) if _OPENERS.search(tail) else ""
        self._closed = not closer
        # a tail that starts mid-statement must not be read as a statement's start: sqlglot turns
        # a leading command word (SHOW, EXECUTE, ...) and the rest of the text into one token
        lead = "SELECT " if start > 0 and self._state.prev != T.SEMICOLON else ""
        toks = self._tok.tokenize(lead + tail + closer)[1 if lead else 0 :]
        end = len(tail) - 1
        for t in toks:
            t.start += start - len(lead)
            t.end = min(t.end - len(lead), end) + start
        return [t for t in toks if t.start - start <= end]

    def _resolves(self, name: str, state: _Clauses) -> bool:
        return name in self._names or name in state.aliases

    def _feed(self, s: _Clauses, tok: Token, nxt: Token | None, growing: bool) -> tuple[int, int, int]:
        """Advance the clause state over one sql token; return its (class, role, state) ranks.

        ``growing``: the token ends the text, so more characters may still join it.
        """
        tt = tok.token_type
        text = tok.text
        frame = s.stack[-1]
        prev, prev_text = s.prev, s.prev_text
        after_table = s.after_table
        s.prev, s.prev_text, s.after_table = tt, text, False
        upper = text.upper()
        if tt == T.SELECT:
            if prev == T.L_PAREN and not frame[1]:
                frame[1] = True
            frame[0] = _PROJ
            return _SCAF, _PROJ, _BOUNDARY
        if tt == T.FROM or tt in _JOIN_WORDS:
            if nxt is not None and nxt.token_type == T.L_PAREN and tt in (T.LEFT, T.RIGHT):
                return _SCAF, frame[0], _STABLE  # LEFT(...) / RIGHT(...) functions
            frame[0] = _REL
            return _SCAF, _REL, _BOUNDARY
        if tt in (T.WHERE, T.HAVING, T.ON):
            frame[0] = _PRED
            s.on = tt == T.ON
            return _SCAF, _PRED, _BOUNDARY
        if tt in _OUTSIDE:
            frame[0] = _OUT
            return _SCAF, _OUT, _BOUNDARY
        if tt == T.L_PAREN:
            s.stack.append([frame[0], False])
            return _SCAF, frame[0], _BOUNDARY
        if tt == T.R_PAREN:
            if len(s.stack) > 1:
                s.stack.pop()
            s.after_table = s.stack[-1][0] == _REL  # "(SELECT ...) AS t" / "(SELECT ...) t"
            if s.after_table:
                s.last_table = None
            return _SCAF, s.stack[-1][0], _BOUNDARY
        if tt == T.COMMA or tt == T.SEMICOLON:
            return _SCAF, frame[0], _BOUNDARY
        if tt == T.STRING or tt == T.NUMBER:
            return _FREE, frame[0], _STABLE
        if tt == T.ALIAS:
            s.after_table = after_table
            return _SCAF, frame[0], _STABLE
        name = text.lower()
        if tt == T.VAR and upper in ("GROUP", "ORDER", "BY") and name not in self._names:
            if upper == "BY" and prev_text.upper() in ("GROUP", "ORDER"):
                frame[0] = _OUT
                s.prev = T.GROUP_BY
                return _SCAF, _OUT, _BOUNDARY
            if upper != "BY" and (nxt is None or nxt.text.upper() == "BY"):
                return _SCAF, frame[0], _BOUNDARY
        if tt not in (T.VAR, T.IDENTIFIER) and (tt in _NEVER_IDENT or not (prev == T.DOT or self._resolves(name, s))):
            if growing and self._grows(tok, s):
                return _SCHEMA, frame[0], _CRITICAL  # "Is" of "Is_male"
            return _SCAF, frame[0], _STABLE  # keyword, operator, type or function word
        # an identifier
        clause = frame[0]
        if nxt is not None and nxt.token_type == T.L_PAREN and tt != T.IDENTIFIER:
            return _SCAF, clause, _STABLE  # function name
        if (nxt is not None and nxt.token_type == T.DOT) or prev == T.DOT:
            return _SCHEMA, clause, _CRITICAL
        if clause == _REL and (prev == T.ALIAS or after_table) and name not in self._tables:
            s.aliases[name] = s.last_table
            return _SCHEMA, clause, _CRITICAL
        if name in self._tables:
            if clause == _REL:
                s.last_table, s.after_table = name, True
            return _SCHEMA, clause, _CRITICAL
        if self._resolves(name, s):
            return _SCHEMA, clause, _CRITICAL
        if growing and self._grows(tok, s):
            return _SCHEMA, clause, _CRITICAL
        return _FREE, clause, _STABLE

    def _grows(self, tok: Token, s: _Clauses) -> bool:
        """Whether a word token (not a clause keyword) is a proper prefix of a table, column or alias."""
        if tok.token_type in _CLAUSE_WORDS or not tok.text.replace("_", "").isalnum():
            return False
        name = tok.text.lower()
        return name in self._prefixes or any(a.startswith(name) and a != name for a in s.aliases)

    def _lookahead(self, s: _Clauses, last: Token | None) -> bool:
        """``last``: the text's last sql token, None when the re-tokenised tail holds none (only
        whitespace or a comment after committed tokens): the committed state still decides."""
        if last is not None and last.end == len(self._text) - 1 and self._grows(last, s):
            return True
        tt = s.prev
        if tt in _LA_AFTER:
            return True
        clause = s.stack[-1][0]
        if tt == T.ALIAS and clause == _REL:
            return True
        return tt in _COMPARE and clause == _PRED and s.on


def _closer(tail: str) -> str:
    """What closes an unterminated quote, bracket identifier or block comment at the end of ``tail``."""
    i, n = 0, len(tail)
    while i < n:
        c = tail[i]
        if c in "'\"`[":
            end = "]" if c == "[" else c
            j = tail.find(end, i + 1)
            if j < 0:
                return end
            i = j + 1
        elif c == "-" and tail.startswith("--", i):
            j = tail.find("\n", i)
            if j < 0:
                return "\n"
            i = j + 1
        elif c == "/" and tail.startswith("/*", i):
            j = tail.find("*/", i + 2)
            if j < 0:
                return "*/" if not tail.endswith("/*") else " */"
            i = j + 2
        else:
            i += 1
    return ""
