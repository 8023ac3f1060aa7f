"""Two text-to-SQL cells compared on their shared cases (e.g. one code version against another).

    .venv/bin/python benchmarks/sql_cells_paired.py DIR_A DIR_B --name NAME [--nonempty-gold]

``DIR``: ``pask eval sql`` output folders. Reported over the shared case ids: identical outputs,
correct in each, the discordant pairs with the exact two-sided sign test, and the execution errors
by kind (no such column / no such table / ambiguous column / other), with each cell's code
version. ``--nonempty-gold``: only the shared cases whose gold query returns rows (on the others
any prediction that returns no rows scores correct); a row without ``gold_empty`` (cells made
before it was recorded) gets it by running its gold query on cell A's data directory
(:func:`pask.tasks.sql.with_gold_empty`; the bundled Spider dev unless A's ``settings.json`` or
``cell.json`` names another).
Results: ``benchmarks/results/sql-scope/<name>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections import Counter
from pathlib import Path

from pask.evaluation.case_rows import read_done
from pask.experiments.provenance import add_allow_dirty, check_clean, write_result
from pask.experiments.report import sign_test_p
from pask.tasks.sql import with_gold_empty

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sql_scope_ab import _code
from sql_scope_audit import error_kind

OUT = Path(__file__).resolve().parent / "results" / "sql-scope"


def data_dir(cell: Path) -> str | None:
    """The ``data_dir`` option a cell was made with (``settings.json`` of ``pask eval``, ``cell.json`` of a sweep)."""
    for name, keys in (("settings.json", ("options",)), ("cell.json", ("spec", "options"))):
        if (cell / name).is_file():
            d = json.loads((cell / name).read_text())
            for k in keys:
                d = d.get(k) or {}
            return d.get("data_dir")
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--name", required=True)
    ap.add_argument(
        "--nonempty-gold", action="store_true", help="only the cases whose gold query returns rows (runs no model)"
    )
    add_allow_dirty(ap)
    args = ap.parse_args()
    check_clean(OUT / args.name, args.allow_dirty)
    a, b = read_done(args.a / "cases.jsonl"), read_done(args.b / "cases.jsonl")
    ids = sorted(set(a) & set(b))
    if not ids:
        raise SystemExit(f"error: {args.a} and {args.b} share no case")
    left_out = 0
    if args.nonempty_gold:
        empty = {r["id"] for r in with_gold_empty([a[i] for i in ids], data_dir(args.a)) if r["gold_empty"]}
        left_out, ids = len(empty), [i for i in ids if i not in empty]
    only_a = sum(bool(a[i]["correct"]) and not b[i]["correct"] for i in ids)
    only_b = sum(bool(b[i]["correct"]) and not a[i]["correct"] for i in ids)
    side = {
        name: {
            "dir": str(d),
            "code": _code(d),
            "correct": sum(bool(rows[i]["correct"]) for i in ids),
            "errors": dict(Counter(error_kind(rows[i]["error"]) for i in ids if rows[i]["error"])),
        }
        for name, d, rows in (("a", args.a, a), ("b", args.b, b))
    }
    result = {
        "cases": len(ids),
        **({"nonempty_gold_only": True, "empty_gold_left_out": left_out} if args.nonempty_gold else {}),
        "identical_outputs": sum(a[i]["output"] == b[i]["output"] for i in ids),
        **side,
        "only_a_correct": only_a,
        "only_b_correct": only_b,
        "sign_test_p": sign_test_p(only_a, only_b),
    }
    command = shlex.join(["python", "benchmarks/sql_cells_paired.py", *sys.argv[1:]])
    lines = [
        "# Two text-to-SQL cells on their shared cases",
        "",
        f"Command: `{command}`",
        "",
        "| cell | code | correct | no such column | other execution errors |",
        "|---|---|---:|---:|---:|",
    ]
    for name in ("a", "b"):
        s, e = side[name], side[name]["errors"]
        nsc = e.get("no such column", 0)
        lines.append(f"| {s['dir']} | {s['code']} | {s['correct']} | {nsc} | {sum(e.values()) - nsc} |")
    scope = f" whose gold query returns rows ({left_out} with an empty gold result left out)"
    lines += [
        "",
        f"{len(ids)} shared cases{scope if args.nonempty_gold else ''}; identical outputs "
        f"{result['identical_outputs']}; discordant pairs: correct only in a {only_a}, only in b {only_b}; "
        f"exact two-sided sign test p = {result['sign_test_p']:.4g}.",
        "",
    ]
    md = "\n".join(lines)
    js, _ = write_result(OUT / args.name, result, md, command=command, allow_dirty=args.allow_dirty)
    print(md, end="")
    print(f"results: {js}")


if __name__ == "__main__":
    main()
