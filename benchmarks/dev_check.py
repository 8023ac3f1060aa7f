"""The dev check of PASK tables: does a table land on its budget on cases it was not calibrated on?

For each table, runs PASK with it on (part of) the task's dev split
(:func:`pask.calibration.calibrate.check_dev`: resumable, one directory per table under
``--work``) and reports the measured B against the table's target and its expected B. The offset
(measured minus expected) is what ``pask calibrate --b-offset`` takes to re-solve a table so that it
lands on its budget (docs/calibration.md, "The dev check"). Dev accuracy is reported beside it; the
dev split is the place to compare tables, never the test split.

    python benchmarks/dev_check.py pask/tables/qwen2.5-coder-0.5b-bfcl-4a-b0.2.json ... \\
        --limit 8 --threads 1 --prefill-store DIR --out benchmarks/results/dev-check/NAME

``--limit``: BFCL cases per category (four non-live categories), SQL the first N dev cases.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

import torch

from pask.calibration.calibrate import check_dev
from pask.experiments.provenance import add_allow_dirty, check_clean, write_result
from pask.policies.table import load
from pask.runtime.models import load_model
from pask.runtime.prefill_store import ENV as PREFILL_ENV


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tables", nargs="+", type=Path, help="PASK table files")
    ap.add_argument("--limit", type=int, default=None, help="bfcl: cases per category; sql: first N")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prefill-store", type=Path, default=None)
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache/pask/dev-check", help="per-table run dirs")
    ap.add_argument("--out", type=Path, required=True, help="result stem (JSON + markdown)")
    add_allow_dirty(ap)
    args = ap.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        ap.error("--limit must be >= 1")
    check_clean(args.out, args.allow_dirty)
    tables = [(path, load(path)) for path in args.tables]  # refuses missing / malformed tables up front
    torch.set_num_threads(args.threads)
    if args.prefill_store is not None:
        os.environ[PREFILL_ENV] = str(args.prefill_store)
    rows, lms = [], {}
    for path, table in tables:
        if table.model_name not in lms:
            lms[table.model_name] = load_model(table.model_name, dtype=torch.bfloat16)
        run_dir = args.work / f"{path.stem}-l{args.limit or 'all'}"
        s = check_dev(lms[table.model_name], table, run_dir, args.limit, args.batch_size)
        meta = table.calibration
        offset = float(meta.get("b_offset") or 0.0)
        acc = s["overall"].get("accuracy", s["overall"].get("ex"))
        row = {
            "table": str(path),
            "task": table.task,
            "target_b": table.target_b,
            "b_offset": offset,
            "expected_b": table.expected_b,
            "predicted_dev_b": round(table.expected_b + offset, 4),
            "measured_b": s["measured_b"],
            "measured_b_prompt": s["measured_b_prompt"],
            "measured_b_decode": s["measured_b_decode"],
            "deviation": round(s["measured_b"] - table.target_b, 4),
            "next_offset": round(s["measured_b"] - table.expected_b, 4),
            "n": s["overall"]["n"],
            "dev_accuracy": acc,
            "calibrated_on": meta.get("split", "calibration"),
            # a table calibrated on dev too (--split calibration+dev) saw these cases: not held out
            "dev_in_sample": "dev" in str(meta.get("split", "")).split("+"),
        }
        rows.append(row)
        print(
            f"{path.name}: measured B {row['measured_b']:.4f} (target {table.target_b:g}, deviation "
            f"{row['deviation']:+.4f}); dev accuracy {acc} on {row['n']}",
            flush=True,
        )
    md = [
        "# Dev check of PASK tables",
        "",
        "Measured B on the dev split against each table's target. `offset`: the table's `--b-offset`; "
        "`next offset`: measured minus expected B, the `--b-offset` that re-solves it onto its target. "
        "A dev accuracy marked * is in-sample: the table was calibrated on the dev split too.",
        "",
        "| table | target B | offset | expected B | measured B | deviation | next offset | B prompt | B decode "
        "| n | dev accuracy |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    md += [
        f"| {Path(r['table']).name} | {r['target_b']:g} | {r['b_offset']:+.4f} | {r['expected_b']:.4f} | "
        f"{r['measured_b']:.4f} | {r['deviation']:+.4f} | {r['next_offset']:+.4f} | {r['measured_b_prompt']:.4f} | "
        f"{r['measured_b_decode']:.4f} | {r['n']} | {r['dev_accuracy']}{' *' if r['dev_in_sample'] else ''} |"
        for r in rows
    ]
    command = "python benchmarks/dev_check.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    write_result(
        args.out,
        {"limit": args.limit, "rows": rows},
        "\n".join(md) + "\n",
        command=command,
        allow_dirty=args.allow_dirty,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
