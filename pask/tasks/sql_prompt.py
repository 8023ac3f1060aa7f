"""Text-to-SQL prompt: the schema as CREATE TABLE statements (with labelled spans) plus the question.

:func:`schema_ddl` returns the DDL text and spans ``(start, end, kind, name)`` that tile it
(every character lies in exactly one span). Kinds and names:

- ``table``: a table name after CREATE TABLE; name ``table``
- ``column``: a column name in its definition; name ``table.column``
- ``type``: the declared type of that column; name ``table.column``
- ``constraint``: a ``PRIMARY KEY (...)`` clause (name ``table.pk``) or a
  ``FOREIGN KEY (...) REFERENCES ...`` clause (name ``table.fk.col1+col2``)
- ``sample``: header and value lines of the optional example rows; name ``table``
- ``scaffold``: everything else (keywords, punctuation, newlines, comment framing); name ``""``

:func:`build_messages` puts the DDL text verbatim into the user message, so its spans shift
by ``messages[1]["content"].index(ddl)``.
"""

from __future__ import annotations

from typing import NamedTuple

from pask.structure.sql_schema import Schema, Table, connect_readonly, quote_identifier
from pask.tasks.text_to_sql import Case

SYSTEM_PROMPT = (
    "You are an expert SQLite developer. Given a database schema and a question, answer with a "
    "single SQLite SELECT query. Output only the SQL query, without explanation or formatting."
)
SAMPLE_VALUE_CHARS = 40
SPAN_KINDS = ("table", "column", "type", "constraint", "sample", "scaffold")


class DdlSpan(NamedTuple):
    start: int
    end: int
    kind: str
    name: str


class _Builder:
    """Appends text pieces and records their spans (consecutive scaffold pieces merged)."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.spans: list[DdlSpan] = []
        self.pos = 0

    def add(self, text: str, kind: str = "scaffold", name: str = "") -> None:
        if not text:
            return
        end = self.pos + len(text)
        last = self.spans[-1] if self.spans else None
        if kind == "scaffold" and last is not None and last.kind == "scaffold":
            self.spans[-1] = last._replace(end=end)
        else:
            self.spans.append(DdlSpan(self.pos, end, kind, name))
        self.parts.append(text)
        self.pos = end


def _names(cols: tuple[str, ...]) -> str:
    return ", ".join(quote_identifier(c) for c in cols)


def _table_ddl(b: _Builder, t: Table) -> None:
    b.add("CREATE TABLE ")
    b.add(quote_identifier(t.name), "table", t.name)
    b.add(" (\n")
    items = len(t.columns) + bool(t.primary_key) + len(t.foreign_keys)
    done = 0

    def sep() -> None:
        nonlocal done
        done += 1
        b.add(",\n" if done < items else "\n")

    for c in t.columns:
        b.add("  ")
        b.add(quote_identifier(c.name), "column", f"{t.name}.{c.name}")
        if c.type:
            b.add(" ")
            b.add(c.type, "type", f"{t.name}.{c.name}")
        sep()
    if t.primary_key:
        b.add("  ")
        b.add(f"PRIMARY KEY ({_names(t.primary_key)})", "constraint", f"{t.name}.pk")
        sep()
    for fk in t.foreign_keys:
        clause = f"FOREIGN KEY ({_names(fk.columns)}) REFERENCES {quote_identifier(fk.ref_table)}"
        if fk.ref_columns:
            clause += f" ({_names(fk.ref_columns)})"
        b.add("  ")
        b.add(clause, "constraint", f"{t.name}.fk.{'+'.join(fk.columns)}")
        sep()
    b.add(");\n")


def _cell(value: object) -> str:
    text = "NULL" if value is None else str(value).replace("\n", " ")
    return text if len(text) <= SAMPLE_VALUE_CHARS else text[: SAMPLE_VALUE_CHARS - 3] + "..."


def _sample_block(b: _Builder, t: Table, rows: list[tuple]) -> None:
    b.add(f"/* {len(rows)} example rows from {quote_identifier(t.name)}:\n")
    b.add(" | ".join(c.name for c in t.columns) + "\n", "sample", t.name)
    for row in rows:
        b.add(" | ".join(_cell(v) for v in row) + "\n", "sample", t.name)
    b.add("*/\n")


def schema_ddl(schema: Schema, sample_rows: int = 0) -> tuple[str, list[DdlSpan]]:
    """The schema as DDL text (tables in database order) and the spans that tile it."""
    b = _Builder()
    conn = connect_readonly(schema.path) if sample_rows > 0 else None
    try:
        for i, t in enumerate(schema.tables):
            if i:
                b.add("\n")
            _table_ddl(b, t)
            if conn is not None:
                cols = ", ".join(quote_identifier(c.name) for c in t.columns)
                rows = conn.execute(f"SELECT {cols} FROM {quote_identifier(t.name)} LIMIT ?", (sample_rows,)).fetchall()
                if rows:
                    _sample_block(b, t, rows)
    finally:
        if conn is not None:
            conn.close()
    return "".join(b.parts), b.spans


def build_messages(case: Case, schema: Schema, sample_rows: int = 0) -> list[dict]:
    """Chat messages (system + user) asking for the SQL query that answers ``case.question``."""
    ddl, _ = schema_ddl(schema, sample_rows)
    user = (
        f"Database schema:\n\n{ddl}\n"
        f"Question: {case.question.strip()}\n\n"
        "Write the SQLite query that answers the question."
    )
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]
