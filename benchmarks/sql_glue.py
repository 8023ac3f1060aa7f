"""Count text-to-SQL outputs with a keyword glued to the next word (``WHEREname``, ``GROUPBY``).

    .venv/bin/python benchmarks/sql_glue.py CELL_DIR [...] [--out benchmarks/results/sql-glue/NAME]

The grammar ignores whitespace between lexemes, so such outputs parse and SQLite rejects them;
the scope constraint refuses them since 6296ac4 (docs/cli.md). An identifier run counts as glued
when it is not a keyword, function, type or schema name of the case's database and it starts with
a keyword followed by digits or by a known word of two or more characters (string literals and
quoted names are skipped). Per cell: the glued outputs, how many of them score correct, examples.
"""

from __future__ import annotations

import argparse
import re
import sys
from functools import cache
from pathlib import Path

from pask.evaluation.case_rows import read_done
from pask.experiments.provenance import add_allow_dirty, check_clean, default_command, write_result
from pask.structure.sql_grammar import AGGREGATES, CAST_TYPES, FUNCTIONS, KEYWORDS
from pask.tasks.text_to_sql import load_schema

_KEYWORDS = frozenset((*KEYWORDS, "like"))
_BASE = _KEYWORDS | frozenset((*AGGREGATES, *FUNCTIONS, *CAST_TYPES))
_QUOTED = re.compile(r"'(?:[^']|'')*'|\"[^\"]*\"|`[^`]*`|\[[^\]]*\]")
_RUN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@cache
def _known(db_id: str) -> frozenset[str]:
    schema = load_schema(db_id)
    names = {t.name.lower() for t in schema.tables} | {c.name.lower() for t in schema.tables for c in t.columns}
    return _BASE | frozenset(names)


def glued(sql: str, db_id: str) -> str | None:
    """The first glued run of ``sql`` (None: none)."""
    known = _known(db_id)
    long = [w for w in known if len(w) >= 2]
    for m in _RUN.finditer(_QUOTED.sub("''", sql)):
        w = m.group().lower()
        if w in known:
            continue
        for k in _KEYWORDS:
            rest = w[len(k) :]
            if w.startswith(k) and rest and (rest.isdigit() or any(rest.startswith(x) for x in long)):
                return m.group()
    return None


def count(cell: Path) -> dict:
    rows = read_done(cell / "cases.jsonl")
    hits = [(i, g, bool(r["correct"])) for i, r in rows.items() if (g := glued(r["output"], r["db_id"]))]
    return {
        "cell": str(cell),
        "n": len(rows),
        "glued": len(hits),
        "correct": sum(c for _, _, c in hits),
        "examples": hits[:5],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cells", nargs="+", type=Path, help="text-to-SQL result cells (with cases.jsonl)")
    ap.add_argument("--out", type=Path, help="result stem (JSON + markdown via the shared writer)")
    add_allow_dirty(ap)
    args = ap.parse_args(argv)
    if args.out:  # refuse a dirty tree before any work
        check_clean(args.out, args.allow_dirty)
    for c in args.cells:
        if not (c / "cases.jsonl").is_file():
            ap.error(f"{c}: no cases.jsonl")
    res = [count(c) for c in args.cells]
    lines = ["| cell | cases | glued outputs | of them correct | examples |", "|---|---:|---:|---:|---|"]
    for r in res:
        ex = ", ".join(f"`{g[:24]}`" for _, g, _ in r["examples"][:3])
        lines.append(f"| {r['cell']} | {r['n']} | {r['glued']} | {r['correct']} | {ex} |")
    text = "# Text-to-SQL outputs with a keyword glued to the next word\n\n" + "\n".join(lines) + "\n"
    if args.out:
        cmd = None if argv is None else default_command([__file__, *argv])
        write_result(args.out, {"cells": res}, text, command=cmd, allow_dirty=args.allow_dirty)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
