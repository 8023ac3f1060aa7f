"""Full KV before and after the one decode core: same outputs, no slower.

    .venv/bin/python benchmarks/full_kv_ab.py --before DIR [--after DIR] [--limit 4] [--batch-size 8] \
        [--rounds 2] [--threads 2] [--work DIR]

``--before`` is a checkout of the code before issue 26 (``git worktree add /tmp/before 9030eb5``),
where Full KV decoded on transformers' ``DynamicCache`` in its own loop; ``--after`` (default: this
tree) runs Full KV as ``FullPolicy`` on the tiered cache through ``Scheduler.step``. Each round runs
``pask eval bfcl --policy full`` on the first ``--limit`` cases of each non-live category in both
trees, alternating which goes first, with ``PASK_BF16_MATMUL=gemv`` on CPUs with BF16 arithmetic so
that both use the same decode linears (``auto`` meant PyTorch's GEMM there before). Reported: per
tree the median over rounds of the mean TPOT and of the cell's wall time (prefills included), the
TPOT ratio after / before, and how many outputs are identical. Results:
``benchmarks/results/full-kv-ab.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

from pask.experiments.provenance import add_allow_dirty, check_clean, code_version, write_result

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "full-kv-ab"


def run_cell(tree: Path, out: Path, args) -> dict:
    """One ``pask eval bfcl --policy full`` in ``tree``; its rows and timings."""
    from pask.cpu import bf16_matmul

    env = dict(os.environ, PYTHONPATH=str(tree))
    if bf16_matmul.cpu_has_bf16():
        env["PASK_BF16_MATMUL"] = "gemv"
    cmd = [sys.executable, "-m", "pask.cli", "eval", "bfcl", "--policy", "full", "--split", "test"]
    cmd += ["--limit", str(args.limit), "--batch-size", str(args.batch_size), "--threads", str(args.threads)]
    cmd += ["--out", str(out)]
    print("$", shlex.join(cmd), f"(in {tree})", flush=True)
    subprocess.run(cmd, check=True, cwd=tree, env=env, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (out / "cases.jsonl").read_text().splitlines() if line.strip()]
    summary = json.loads((out / "summary.json").read_text())
    return {
        "outputs": {r["id"]: r["output"] for r in rows},
        "tpot_ms": statistics.fmean(r["tpot_ms"] for r in rows if r["n_generated"] > 1),
        "wall_s": (summary.get("run") or {}).get("wall_s_this_run"),  # the cell's cases, prefills included
        "tokens": sum(r["n_generated"] for r in rows),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, required=True, help="checkout of the code before the change")
    ap.add_argument("--after", type=Path, default=ROOT)
    ap.add_argument("--limit", type=int, default=4, help="cases per non-live BFCL category")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache" / "pask" / "full-kv-ab")
    add_allow_dirty(ap)
    args = ap.parse_args()
    command = "python benchmarks/full_kv_ab.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    check_clean(OUT, args.allow_dirty)
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for r in range(args.rounds):
        order = ("before", "after") if r % 2 == 0 else ("after", "before")
        for side in order:
            out = args.work / f"{side}-{r}"
            if out.exists():
                subprocess.run(["rm", "-rf", str(out)], check=True)
            runs[side].append(run_cell(trees[side], out, args))
            print(side, r, {k: v for k, v in runs[side][-1].items() if k != "outputs"}, flush=True)
    a, b = runs["before"][0]["outputs"], runs["after"][0]["outputs"]
    ids = sorted(set(a) & set(b))
    med = {s: {k: statistics.median(x[k] for x in runs[s]) for k in ("tpot_ms", "wall_s")} for s in runs}
    result = {
        "command": command,
        "before": code_version(trees["before"]),
        "after": code_version(trees["after"]),
        "cases": len(ids),
        "identical_outputs": sum(a[i] == b[i] for i in ids),
        "tokens": {s: runs[s][0]["tokens"] for s in runs},
        "median": med,
        "tpot_ratio_after_over_before": round(med["after"]["tpot_ms"] / med["before"]["tpot_ms"], 3),
        "rounds": {s: [{k: v for k, v in x.items() if k != "outputs"} for x in runs[s]] for s in runs},
        "batch_size": args.batch_size,
        "threads": args.threads,
    }
    md = [
        "# Full KV before and after the one decode core",
        "",
        f"Command: `{command}`",
        "",
        f"Before: `{result['before']['commit'][:10]}` (DynamicCache, its own loop); after: "
        f"`{result['after']['commit'][:10]}` (FullPolicy on the tiered cache, `Scheduler.step`). BFCL test, "
        f"first {args.limit} cases of each non-live category, batch {args.batch_size}, static batches, "
        f"{args.threads} threads, {args.rounds} rounds alternating the order; same decode linears in both.",
        "",
        "| tree | median mean TPOT ms | median cell wall s | generated tokens |",
        "|---|---:|---:|---:|",
    ]
    for s in ("before", "after"):
        md.append(f"| {s} | {med[s]['tpot_ms']:.1f} | {med[s]['wall_s']:.1f} | {result['tokens'][s]} |")
    md += [
        "",
        f"TPOT after / before: {result['tpot_ratio_after_over_before']}. Identical outputs: "
        f"{result['identical_outputs']}/{result['cases']}. Outputs may differ where the code before "
        "prefilled a static batch as one left-padded forward (in bf16 a padded row's K/V differ in the last "
        "bits); the decode core prefills each prompt alone.",
    ]
    write_result(OUT, result, "\n".join(md) + "\n", command=command, allow_dirty=args.allow_dirty)
    print("\n".join(md))


if __name__ == "__main__":
    main()
