"""Calibration transfer (paper Table 4 layout) from evaluation directories of one model.

    .venv/bin/python benchmarks/transfer_table.py \
        "PASK (trans)=benchmarks/results/transfer-1.5b/pask-trans" \
        "PASK (recalib)=benchmarks/results/transfer-1.5b/pask-recalib" \
        [--out benchmarks/results/transfer-1.5b/table4]

Each argument is ``LABEL=DIR`` (a ``pask eval bfcl --out DIR``). Rows: per-category accuracy and
measured B from each directory's ``summary.json``; below them the paired comparison of every row
with the first on the cases both hold (discordant pairs and the exact sign test). Writes
``OUT.json`` and ``OUT.md`` with this command.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from pask.evaluation.case_rows import read_done
from pask.experiments.provenance import add_allow_dirty, check_clean, write_result
from pask.experiments.report import sign_test_p

CATS = ("simple", "multiple", "parallel", "parallel_multiple")


def _cell(label: str, d: Path) -> dict:
    summary = d / "summary.json"
    if not summary.exists():
        raise SystemExit(f"{label}: no summary.json in {d} (is the evaluation finished?)")
    s = json.loads(summary.read_text())
    run = s["run"]
    return {
        "label": label,
        "dir": str(d),
        "model": run["model"],
        "policy": run["policy"],
        "table_sha256": run.get("table_sha256"),
        "measured_b": s.get("measured_b"),
        "categories": {c: s["categories"][c]["accuracy"] for c in CATS if c in s["categories"]},
        "n": s["overall"]["n"],
        "overall": s["overall"]["accuracy"],
        "command": run.get("command"),
        "wall_s": run.get("wall_s_this_run"),
        "rows": read_done(d / "cases.jsonl"),
    }


def table(cells: list[dict]) -> tuple[str, list[dict]]:
    models = {c["model"] for c in cells}
    if len(models) != 1:
        raise SystemExit(f"cells of different models: {sorted(models)}")
    cats = [c for c in CATS if all(c in x["categories"] for x in cells)]
    lines = [
        f"Model: {models.pop()}. BFCL accuracy (%) under calibration transfer (Table 4 layout).",
        "",
        "| Method | B | " + " | ".join(cats) + " | Overall | n |",
        "|---|---:|" + "---:|" * len(cats) + "---:|---:|",
    ]
    for c in cells:
        b = f"{c['measured_b']:.3f}" if c["measured_b"] is not None else "1.000"
        accs = " | ".join(f"{c['categories'][k]:.2f}" for k in cats)
        lines.append(f"| {c['label']} | {b} | {accs} | {c['overall']:.2f} | {c['n']} |")
    pairs = []
    ref = cells[0]
    for c in cells[1:]:
        shared = sorted(set(ref["rows"]) & set(c["rows"]))
        a = sum(bool(c["rows"][i]["correct"]) and not ref["rows"][i]["correct"] for i in shared)
        b = sum(bool(ref["rows"][i]["correct"]) and not c["rows"][i]["correct"] for i in shared)
        pairs.append({"row": c["label"], "vs": ref["label"], "shared": len(shared), "only_row": a, "only_ref": b})
    if pairs:
        lines += ["", f"Paired with {ref['label']} (cases only the row gets right : only {ref['label']}):", ""]
        lines += [
            f"- {p['row']}: {p['only_row']} : {p['only_ref']} on {p['shared']} shared cases "
            f"(exact sign test p = {sign_test_p(p['only_row'], p['only_ref']):.2f})"
            for p in pairs
        ]
    lines += ["", "Cells:", ""] + [f"- {c['label']}: `{c['command']}`" for c in cells]
    return "\n".join(lines) + "\n", pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cells", nargs="+", help="LABEL=DIR, the first is the paired reference")
    ap.add_argument("--out", type=Path, help="write OUT.json and OUT.md")
    add_allow_dirty(ap)
    args = ap.parse_args()
    if args.out:
        check_clean(args.out, args.allow_dirty)
    cells = []
    for arg in args.cells:
        label, sep, d = arg.partition("=")
        if not sep or not label or not d:
            raise SystemExit(f"expected LABEL=DIR, got {arg!r}")
        cells.append(_cell(label, Path(d)))
    md, pairs = table(cells)
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    md += f"\nCommand: `{command}`\n"
    print(md, end="")
    if args.out:
        rows = [{k: v for k, v in c.items() if k != "rows"} for c in cells]
        data = {"cells": rows, "paired": pairs, "command": command}
        write_result(args.out, data, md, command=command, allow_dirty=args.allow_dirty)


if __name__ == "__main__":
    main()
