"""Cases per second with and without batching (BFCL, Full KV), same cases, same run.

    .venv/bin/python benchmarks/batching.py [--model qwen2.5-coder-0.5b] [--limit 6] [--batch-sizes 1,8]

Writes benchmarks/results/batching.json and .md. Batch sizes run interleaved-free but back to
back on the same cases; compare the ratio, not the absolute numbers (machines are noisy).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

from pask.evaluation.run_bfcl import run_bfcl
from pask.experiments.provenance import add_allow_dirty, check_clean, write_result
from pask.runtime.models import load_model
from pask.tasks.function_calling import NON_LIVE, load_cases

OUT = Path(__file__).resolve().parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--limit", type=int, default=6, help="cases per non-live category")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--threads", type=int, default=2)
    add_allow_dirty(ap)
    args = ap.parse_args()
    check_clean(OUT / "batching", args.allow_dirty)
    torch.set_num_threads(args.threads)
    lm = load_model(args.model)
    cases = load_cases(list(NON_LIVE), split="test", limit=args.limit)
    rows = []
    for bs in [int(x) for x in args.batch_sizes.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            summary = run_bfcl(lm, cases, Path(tmp), batch_size=bs)
            wall = time.perf_counter() - t0
        rows.append(
            {
                "batch_size": bs,
                "cases": len(cases),
                "wall_s": round(wall, 1),
                "cases_per_s": round(len(cases) / wall, 3),
                "accuracy": summary["overall"]["accuracy"],
            }
        )
        print(rows[-1], flush=True)
    base = rows[0]["cases_per_s"]
    for r in rows:
        r["speedup_vs_first"] = round(r["cases_per_s"] / base, 2)
    command = "python benchmarks/batching.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    result = {"command": command, "model": lm.name, "threads": args.threads, "torch": torch.__version__, "runs": rows}
    lines = [
        "# Batching: BFCL cases per second (Full KV)",
        "",
        f"Command: `{command}`  ",
        f"Model {lm.name}, {args.threads} threads, {len(cases)} non-live test cases ({args.limit} per category).",
        "",
        "| batch size | wall s | cases/s | speed-up | accuracy % |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['batch_size']} | {r['wall_s']} | {r['cases_per_s']} | {r['speedup_vs_first']}x | {r['accuracy']} |"
        )
    md = "\n".join(lines) + "\n"
    write_result(OUT / "batching", result, md, command=command, allow_dirty=args.allow_dirty)


if __name__ == "__main__":
    main()
