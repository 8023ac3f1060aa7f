"""Compare KV policies on one BFCL sample at one target budget (paper Table 1 layout, measured B).

    .venv/bin/python benchmarks/compare_policies.py --budget 0.33 --limit 10 \
        --policies full,kivi-4,snapkv,h2o [--split test] [--out benchmarks/results/compare-b0.33]

Each policy's per-case results go to OUT/<policy>/ (resumable: rerun to continue); the combined
table goes to OUT/summary.md and OUT/summary.json with the command that produced them.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import torch

from pask.cli import make_policy
from pask.evaluation.run_bfcl import LIVE_ORDER, TABLE_ORDER, run_bfcl
from pask.experiments.provenance import add_allow_dirty, check_clean, write_result
from pask.runtime.models import load_model
from pask.tasks.function_calling import NON_LIVE, load_cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--budget", type=float, default=0.33)
    ap.add_argument("--policies", default="full,kivi-4,snapkv,h2o")
    ap.add_argument("--split", default="test")
    ap.add_argument("--categories", default=",".join(NON_LIVE))
    ap.add_argument("--limit", type=int, default=10, help="cases per category")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    add_allow_dirty(ap)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = args.out or Path(__file__).resolve().parent / "results" / f"compare-b{args.budget}"
    check_clean(out, args.allow_dirty)
    command = "python benchmarks/compare_policies.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    lm = load_model(args.model)
    cases = load_cases(args.categories.split(","), split=args.split, limit=args.limit)
    rows = []
    for name in args.policies.split(","):
        policy = make_policy(name, None if name == "full" else args.budget)
        t0 = time.perf_counter()
        meta = {"model": lm.name, "policy": name, "budget": args.budget, "command": command}
        summary = run_bfcl(lm, cases, out / name, args.batch_size, policy=policy, meta=meta)
        rows.append({"policy": name, "wall_s": round(time.perf_counter() - t0, 1), **summary})
        print(name, summary["overall"]["accuracy"], summary["measured_b"], flush=True)
    cats = [c for c in (*TABLE_ORDER, *LIVE_ORDER) if c in rows[0]["categories"]]
    lines = [
        f"# BFCL {args.split} sample: policies at target B = {args.budget}",
        "",
        f"Command: `{command}`  ",
        f"Model {lm.name} (bf16), {len(cases)} cases ({args.limit} per category), greedy, grammar-constrained.",
        "B is the measured total budget (mean over cases of held KV bytes / Full-KV bytes at the end).",
        "",
        "| Method | B (measured) | " + " | ".join(cats) + " | Overall |",
        "|---|---|" + "---|" * (len(cats) + 1),
    ]
    for r in rows:
        accs = " | ".join(f"{r['categories'][c]['accuracy']:.2f}" for c in cats)
        lines.append(f"| {r['policy']} | {r['measured_b']:.3f} | {accs} | {r['overall']['accuracy']:.2f} |")
    data = {"command": command, "rows": rows}
    write_result(out / "summary", data, "\n".join(lines) + "\n", command=command, allow_dirty=args.allow_dirty)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
