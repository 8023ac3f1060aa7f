"""Execution errors of committed text-to-SQL cells, and what a scope check would have caught.

    .venv/bin/python benchmarks/sql_scope_audit.py [--results benchmarks/results/sql-test] [--name NAME]

For every committed cell (``cases.jsonl``) under ``--results``: the execution errors by kind (no such
column / no such table / ambiguous column / other), and, for each output, the names its scopes do
not provide (:func:`pask.structure.sql_scope.scope_errors`): how many of the ``no such column``
failures the scope check flags (its recall on real failures) and how many outputs that executed
were flagged (false alarms: each would have been steered away from an executable query). No model
runs; the gold queries of Spider dev are checked too (all must be in scope). Results:
``benchmarks/results/sql-scope/<name>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections import Counter
from pathlib import Path

from pask.experiments.provenance import add_allow_dirty, check_clean, write_result
from pask.structure.sql_scope import scope_errors
from pask.tasks.text_to_sql import load_cases, load_schema

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "sql-scope"


def error_kind(error: str | None) -> str | None:
    """The kind of a recorded execution error (None: it executed)."""
    if not error:
        return None
    msg = error.split(": ", 1)[1] if ": " in error else error
    if msg.startswith("no such column"):
        return "no such column"
    if msg.startswith("no such table"):
        return "no such table"
    return "ambiguous column" if "ambiguous" in msg else "other"


def audit_cell(path: Path, schemas: dict) -> dict:
    """One cell's error kinds and the scope check's verdicts on its outputs."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    kinds, flagged = Counter(), Counter()
    for r in rows:
        kind = error_kind(r.get("error")) or "executed"
        kinds[kind] += 1
        schema = schemas.setdefault(r["db_id"], load_schema(r["db_id"]))
        if scope_errors(r["output"], schema):
            flagged[kind] += 1
    missing = kinds["no such column"]
    return {
        "cell": str(path.parent.relative_to(ROOT)),
        "cases": len(rows),
        "errors": {k: v for k, v in kinds.items() if k != "executed"},
        "flagged": dict(flagged),
        "no_such_column_caught": flagged["no such column"],
        "no_such_column": missing,
        "recall": round(flagged["no such column"] / missing, 4) if missing else None,
        "false_alarms": flagged["executed"],
        "executed": kinds["executed"],
    }


def markdown(result: dict, command: str) -> str:
    lines = [
        "# Scope check on committed text-to-SQL outputs",
        "",
        f"Command: `{command}`",
        "",
        f"Spider dev gold queries in scope: {result['gold_in_scope']}/{result['gold']}.",
        "",
        "| cell | cases | no such column | caught | recall | no such table | ambiguous | other "
        "| executed | flagged among executed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in result["cells"]:
        e = c["errors"]
        recall = "-" if c["recall"] is None else f"{100 * c['recall']:.1f} %"
        lines.append(
            f"| {c['cell'].split('/')[-1]} | {c['cases']} | {c['no_such_column']} | {c['no_such_column_caught']} "
            f"| {recall} | {e.get('no such table', 0)} | {e.get('ambiguous column', 0)} | {e.get('other', 0)} "
            f"| {c['executed']} | {c['false_alarms']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results" / "sql-test")
    ap.add_argument("--name", default="sql-test")
    add_allow_dirty(ap)
    args = ap.parse_args()
    check_clean(OUT / args.name, args.allow_dirty)
    cells = sorted(args.results.resolve().rglob("cases.jsonl"))
    if not cells:
        raise SystemExit(f"error: no cases.jsonl under {args.results}")
    schemas: dict = {}
    gold = load_cases()
    in_scope = sum(not scope_errors(c.gold_sql, schemas.setdefault(c.db_id, load_schema(c.db_id))) for c in gold)
    result = {"gold": len(gold), "gold_in_scope": in_scope, "cells": [audit_cell(p, schemas) for p in cells]}
    command = shlex.join(["python", "benchmarks/sql_scope_audit.py", *sys.argv[1:]])
    js, _ = write_result(OUT / args.name, result, markdown(result, command), command=command,
                         allow_dirty=args.allow_dirty)  # fmt: skip
    print(markdown(result, command), end="")
    print(f"results: {js}")


if __name__ == "__main__":
    main()
