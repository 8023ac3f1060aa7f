"""Paired comparison of one evaluation directory with committed cells (BFCL or SQL).

    .venv/bin/python benchmarks/compare_cells.py benchmarks/results/calibration-all4/pask-b0.33-parallel \
        [--cells benchmarks/results/paper/qwen2.5-coder-0.5b/bfcl/test] [--out FILE.md]

For every cell of ``--cells`` holding the same case ids: accuracy of both on the shared cases, the
discordant pairs (cases only one of the two gets right) and the exact sign test's p; also the mean
measured B, the outputs identical in both (the same generated text), and for BFCL the share of
single-call outputs (the parallel failure mode). SQL rows (no category) group by difficulty.
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
        "| cell | shared cases | new acc | cell acc | new only : cell only | sign-test p | new B | cell B "
        "| identical outputs | single-call outputs new / cell |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for cell in sorted(p for p in cells.iterdir() if p.is_dir()):
        old = _rows(cell)
        shared = [i for i in ids if i in old]
        if not shared:
            continue
        a = sum(bool(new[i]["correct"]) for i in shared)
        b = sum(bool(old[i]["correct"]) for i in shared)
        only_a = sum(bool(new[i]["correct"]) and not old[i]["correct"] for i in shared)
        only_b = sum(bool(old[i]["correct"]) and not new[i]["correct"] for i in shared)
        nb = [x for x in (_b(new[i]) for i in shared) if x is not None]
        ob = [x for x in (_b(old[i]) for i in shared) if x is not None]
        single_new = sum(new[i]["output"].count('"name"') == 1 for i in shared) if calls else "-"
        single_old = sum(old[i]["output"].count('"name"') == 1 for i in shared) if calls else "-"
        same = sum(new[i].get("output") == old[i].get("output") for i in shared)
        lines.append(
            f"| {cell.name} | {len(shared)} | {100 * a / len(shared):.2f} | {100 * b / len(shared):.2f} | "
            f"{only_a} : {only_b} | {sign_test_p(only_a, only_b):.3f} | "
            f"{sum(nb) / len(nb) if nb else float('nan'):.3f} | {sum(ob) / len(ob) if ob else float('nan'):.3f} | "
            f"{same} | {single_new} / {single_old} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("new", nargs="+", type=Path, help="evaluation output directories (cases.jsonl)")
    ap.add_argument("--cells", type=Path, default=ROOT / "results/paper/qwen2.5-coder-0.5b/bfcl/test")
    ap.add_argument("--out", type=Path, help="write the markdown here too (OUT.md, and OUT.json with the inputs)")
    add_allow_dirty(ap)
    args = ap.parse_args()
    if args.out:
        check_clean(args.out, args.allow_dirty)
    md = compare(args.new, args.cells)
    command = "python benchmarks/compare_cells.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    md = f"Command: `{command}`\n\n" + md
    print(md)
    if args.out:
        data = {"command": command, "new": [str(d) for d in args.new], "cells": str(args.cells)}
        write_result(args.out, data, md, command=command, allow_dirty=args.allow_dirty)


if __name__ == "__main__":
    main()
