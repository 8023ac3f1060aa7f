"""Database schema of one SQLite file: tables, typed columns, primary and foreign keys."""

from __future__ import annotations

import re
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from pask.errors import PaskError

SQLITE_MAGIC = b"SQLite format 3\x00"
_BARE_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class Column:
    name: str
    type: str  # declared type as written in the database ("" when untyped)


@dataclass(frozen=True)
class ForeignKey:
    columns: tuple[str, ...]
    ref_table: str
    ref_columns: tuple[str, ...]


@dataclass(frozen=True)
class Table:
    name: str
    columns: tuple[Column, ...]
    primary_key: tuple[str, ...]
    foreign_keys: tuple[ForeignKey, ...]


@dataclass(frozen=True)
class Schema:
    db_id: str
    tables: tuple[Table, ...]
    path: Path

    def column_names(self) -> list[str]:
        """All column names, first spelling of each case-insensitive name, in schema order."""
        seen: dict[str, str] = {}
        for t in self.tables:
            for c in t.columns:
                seen.setdefault(c.name.lower(), c.name)
        return list(seen.values())


def is_bare_identifier(name: str) -> bool:
    """Whether ``name`` can be written without quotes (ASCII word not starting with a digit)."""
    return _BARE_IDENTIFIER.fullmatch(name) is not None


def quote_identifier(name: str) -> str:
    """``name`` as written in SQL: bare when possible, else double-quoted."""
    return name if is_bare_identifier(name) else '"' + name.replace('"', '""') + '"'


def check_sqlite_file(path: Path) -> None:
    """Raise :class:`PaskError` unless ``path`` is an existing SQLite database file."""
    if not path.is_file():
        raise PaskError(f"database file not found: {path}")
    with path.open("rb") as f:
        if f.read(len(SQLITE_MAGIC)) != SQLITE_MAGIC:
            raise PaskError(f"not a SQLite database: {path}")


def connect_readonly(path: Path) -> sqlite3.Connection:
    """A read-only connection (``mode=ro`` and ``PRAGMA query_only``) to an existing SQLite file."""
    check_sqlite_file(path)
    conn = sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True)
    conn.execute("PRAGMA query_only=ON")
    conn.text_factory = lambda b: b.decode("utf-8", errors="replace")
    return conn


def read_schema(path: Path, db_id: str | None = None) -> Schema:
    """Read the schema of a SQLite file from its catalog (``PRAGMA table_info`` / ``foreign_key_list``)."""
    conn = connect_readonly(path)
    try:
        names = [
            r[0]
            for r in conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY rowid"
            )
        ]
        pk_of = {}
        for name in names:
            info = conn.execute(f"PRAGMA table_info({quote_identifier(name)})").fetchall()
            pk_of[name.lower()] = tuple(r[1] for r in sorted((r for r in info if r[5]), key=lambda r: r[5]))
        tables = []
        for name in names:
            info = conn.execute(f"PRAGMA table_info({quote_identifier(name)})").fetchall()
            columns = tuple(Column(r[1], r[2] or "") for r in info)
            tables.append(Table(name, columns, pk_of[name.lower()], _foreign_keys(conn, name, pk_of)))
    except sqlite3.DatabaseError as e:
        raise PaskError(f"cannot read schema of {path}: {e}") from e
    finally:
        conn.close()
    return Schema(db_id or path.stem, tuple(tables), path)


def _foreign_keys(conn: sqlite3.Connection, table: str, pk_of: dict[str, tuple[str, ...]]) -> tuple[ForeignKey, ...]:
    """Foreign keys of ``table``; a missing target column means the target's primary key."""
    groups: dict[int, list[tuple]] = {}
    for r in conn.execute(f"PRAGMA foreign_key_list({quote_identifier(table)})"):
        groups.setdefault(r[0], []).append(r)
    fks = []
    for _, rows in sorted(groups.items(), reverse=True):  # SQLite numbers them last-declared first
        rows.sort(key=lambda r: r[1])
        ref_table = rows[0][2]
        cols = tuple(r[3] for r in rows)
        refs = tuple(r[4] for r in rows)
        if any(c is None for c in refs):
            refs = pk_of.get(ref_table.lower(), ())[: len(cols)]
        fks.append(ForeignKey(cols, ref_table, refs))
    return tuple(fks)
