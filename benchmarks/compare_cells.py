"""Paired comparison of one evaluation directory with committed cells (BFCL or SQL).

    .venv/bin/python benchmarks/compare_cells.py benchmarks/results/calibration-all4/pask-b0.33-parallel \
        [--cells benchmarks/results/paper/qwen2.5-coder-0.5b/bfcl/test] [--out FILE.md]

For every cell of ``--cells`` holding the same case ids: accuracy of both on the shared cases, the
discordant pairs (cases only one of the two gets right) and the exact sign test's p; also the mean
measured B, the outputs identical in both (the same generated text), and for BFCL the share of
single-call outputs (the parallel failure mode). SQL rows (no category) group by difficulty.

With ``--by-name`` the one positional directory holds cells (a table re-run on another machine or
version) and each is compared only with its namesake under ``--cells``:

    .venv/bin/python benchmarks/compare_cells.py --by-name NEW/qwen2.5-coder-0.5b/sql/test \
        --cells OLD/qwen2.5-coder-0.5b/sql/test
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from pask.evaluation.case_rows import read_done
from pask.experiments.provenance import add_allow_dirty, check_clean, write_result
from pask.experiments.report import sign_test_p

ROOT = Path(__file__).resolve().parent


def _rows(d: Path) -> dict[str, dict]:
    return read_done(d / "cases.jsonl")


def _b(r: dict) -> float | None:
    b = r.get("budget") or {}
    return b.get("b_total")  # the measured B the summaries and the report use (final, per case)


def _row(name: str, new: dict[str, dict], old: dict[str, dict], calls: bool) -> str | None:
    """One table row: ``new`` against ``old`` on the case ids both hold (None when they share none)."""
    shared = [i for i in sorted(new) if i in old]
    if not shared:
        return None
    a = sum(bool(new[i]["correct"]) for i in shared)
    b = sum(bool(old[i]["correct"]) for i in shared)
    only_a = sum(bool(new[i]["correct"]) and not old[i]["correct"] for i in shared)
    only_b = sum(bool(old[i]["correct"]) and not new[i]["correct"] for i in shared)
    nb = [x for x in (_b(new[i]) for i in shared) if x is not None]
    ob = [x for x in (_b(old[i]) for i in shared) if x is not None]
    single_new = sum(new[i]["output"].count('"name"') == 1 for i in shared) if calls else "-"
    single_old = sum(old[i]["output"].count('"name"') == 1 for i in shared) if calls else "-"
    same = sum(new[i].get("output") == old[i].get("output") for i in shared)
    return (
        f"| {name} | {len(shared)} | {100 * a / len(shared):.2f} | {100 * b / len(shared):.2f} | "
        f"{only_a} : {only_b} | {sign_test_p(only_a, only_b):.3f} | "
        f"{sum(nb) / len(nb) if nb else float('nan'):.3f} | {sum(ob) / len(ob) if ob else float('nan'):.3f} | "
        f"{same} | {single_new} / {single_old} |"
    )


_HEADER = [
    "| cell | shared cases | new acc | cell acc | new only : cell only | sign-test p | new B | cell B "
    "| identical outputs | single-call outputs new / cell |",
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
]


def compare_by_name(new_cells: Path, cells: Path) -> str:
    """Each cell of ``new_cells`` against the cell of the same name in ``cells`` (a re-run of a table)."""
    pairs = [(c, cells / c.name) for c in sorted(new_cells.iterdir()) if c.is_dir() and (cells / c.name).is_dir()]
    if not pairs:
        raise SystemExit(f"no cell of {new_cells} has a namesake in {cells}")
    lines = [f"New cells: {new_cells}; each against its namesake in {cells}.", "", *_HEADER]
    for new_dir, old_dir in pairs:
        new = _rows(new_dir)
        row = _row(new_dir.name, new, _rows(old_dir), bool(new) and all("calls" in r for r in new.values()))
        if row:
            lines.append(row)
    return "\n".join(lines) + "\n"


def compare(new_dirs: list[Path], cells: Path) -> str:
    new = {}
    for d in new_dirs:
        new.update(_rows(d))
    if not new:
        raise SystemExit(f"no case rows under {', '.join(map(str, new_dirs))}")
    ids = sorted(new)
    cats = sorted({new[i].get("category") or new[i].get("difficulty", "?") for i in ids})
    calls = all("calls" in new[i] for i in ids)  # BFCL rows: count single-call outputs
    lines = [
        f"New run: {', '.join(str(d) for d in new_dirs)} ({len(ids)} cases; categories {', '.join(cats)}).",
        "",
        *_HEADER,
    ]
    for cell in sorted(p for p in cells.iterdir() if p.is_dir()):
        row = _row(cell.name, new, _rows(cell), calls)
        if row:
            lines.append(row)
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("new", nargs="+", type=Path, help="evaluation output directories (cases.jsonl)")
    ap.add_argument("--cells", type=Path, default=ROOT / "results/paper/qwen2.5-coder-0.5b/bfcl/test")
    ap.add_argument(
        "--by-name",
        action="store_true",
        help="NEW is one directory of cells; compare each only with its namesake under --cells (a re-run table)",
    )
    ap.add_argument("--out", type=Path, help="write the markdown here too (OUT.md, and OUT.json with the inputs)")
    add_allow_dirty(ap)
    args = ap.parse_args()
    if args.out:
        check_clean(args.out, args.allow_dirty)
    if args.by_name and len(args.new) != 1:
        ap.error("--by-name takes one directory of cells")
    md = compare_by_name(args.new[0], args.cells) if args.by_name else compare(args.new, args.cells)
    command = "python benchmarks/compare_cells.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    md = f"Command: `{command}`\n\n" + md
    print(md)
    if args.out:
        data = {"command": command, "new": [str(d) for d in args.new], "cells": str(args.cells)}
        write_result(args.out, data, md, command=command, allow_dirty=args.allow_dirty)


if __name__ == "__main__":
    main()
