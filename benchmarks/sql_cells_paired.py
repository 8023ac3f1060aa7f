"""Two text-to-SQL cells compared on their shared cases (e.g. one code version against another).

    .venv/bin/python benchmarks/sql_cells_paired.py DIR_A DIR_B --name NAME

``DIR``: ``pask eval sql`` output folders. Reported over the shared case ids: identical outputs,
correct in each, the discordant pairs with the exact two-sided sign test, and the execution errors
by kind (no such column / no such table / ambiguous column / other), with each cell's code
version. Results: ``benchmarks/results/sql-scope/<name>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections import Counter
from pathlib import Path

from pask.evaluation.case_rows import read_done
from pask.experiments.provenance import add_allow_dirty, check_clean, write_result
from pask.experiments.report import sign_test_p

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sql_scope_ab import _code
from sql_scope_audit import error_kind

OUT = Path(__file__).resolve().parent / "results" / "sql-scope"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--name", required=True)
    add_allow_dirty(ap)
    args = ap.parse_args()
    check_clean(OUT / args.name, args.allow_dirty)
    a, b = read_done(args.a / "cases.jsonl"), read_done(args.b / "cases.jsonl")
    ids = sorted(set(a) & set(b))
    if not ids:
        raise SystemExit(f"error: {args.a} and {args.b} share no case")
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
    lines += [
        "",
        f"{len(ids)} shared cases; identical outputs {result['identical_outputs']}; discordant pairs: correct only "
        f"in a {only_a}, only in b {only_b}; exact two-sided sign test p = {result['sign_test_p']:.4g}.",
        "",
    ]
    md = "\n".join(lines)
    js, _ = write_result(OUT / args.name, result, md, command=command, allow_dirty=args.allow_dirty)
    print(md, end="")
    print(f"results: {js}")


if __name__ == "__main__":
    main()
