"""Static vs continuous batching of the text-to-SQL runner: wall time and identical outputs.

    .venv/bin/python benchmarks/continuous_batching.py [--policy pask --budget 0.4] [--limit 120] \
        [--batch-size 8] [--threads 2] [--prefill-store DIR]
    .venv/bin/python benchmarks/continuous_batching.py --compare STATIC_DIR CONTINUOUS_DIR

The first form runs the first ``--limit`` test cases twice back to back in one process, static
batches (each runs to its longest case) then continuous batching (a finished row takes the next
case), and reports cases/s of both and how many outputs are identical. The second compares two
finished runs of the same cases (e.g. a committed sweep cell and a ``pask eval sql --batching
continuous`` rerun): identical outputs, EX and measured B of each. Results:
``benchmarks/results/continuous-batching/<name>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from pathlib import Path

from pask.experiments.provenance import add_allow_dirty, check_clean, write_result

OUT = Path(__file__).resolve().parent / "results" / "continuous-batching"
ROOT = Path(__file__).resolve().parent.parent


def _rows(d: Path) -> dict[str, dict]:
    from pask.evaluation.case_rows import read_done

    return read_done(d / "cases.jsonl")


def compare(a: dict[str, dict], b: dict[str, dict]) -> dict:
    """Identical outputs / stop reasons / correctness over the shared ids; EX and measured B of each."""
    ids = sorted(set(a) & set(b))
    if not ids:
        raise SystemExit("the two runs share no case ids")

    def b_of(rows: dict, i: str) -> float:
        return (rows[i].get("budget") or {}).get("b_total", 1.0)

    return {
        "cases": len(ids),
        "identical_outputs": sum(a[i]["output"] == b[i]["output"] for i in ids),
        "same_correctness": sum(a[i]["correct"] == b[i]["correct"] for i in ids),
        "ex": [round(100 * sum(r[i]["correct"] for i in ids) / len(ids), 2) for r in (a, b)],
        "measured_b": [round(sum(b_of(r, i) for i in ids) / len(ids), 4) for r in (a, b)],
        "generated_tokens": [sum(r[i]["n_generated"] for i in ids) for r in (a, b)],
    }


def run_both(args) -> dict:
    import torch

    from pask.cli import _policy_builder
    from pask.evaluation.run_sql import run_sql, select_cases
    from pask.runtime.models import load_model

    torch.set_num_threads(args.threads)
    if args.prefill_store:
        import os

        os.environ["PASK_PREFILL_STORE"] = str(args.prefill_store)
    table = ROOT / f"pask/tables/{args.model}-sql-b{args.budget:g}.json" if args.policy == "pask" else None
    build = _policy_builder("sql", args.policy, args.budget if args.policy != "full" else None, None, table, False)
    lm = load_model(args.model)
    cases = select_cases("test", args.limit)
    runs, rows = [], []
    for batching in ("static", "continuous"):
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            s = run_sql(lm, cases, Path(tmp), args.batch_size, policy=build(lm), batching=batching)
            wall = time.perf_counter() - t0
            rows.append(_rows(Path(tmp)))
        runs.append({"batching": batching, "wall_s": round(wall, 1), "cases_per_s": round(len(cases) / wall, 3)})
        runs[-1]["ex"] = s["overall"]["ex"]
        print(runs[-1], flush=True)
    runs[1]["speedup"] = round(runs[1]["cases_per_s"] / runs[0]["cases_per_s"], 2)
    return {"model": lm.name, "policy": args.policy, "budget": args.budget, "threads": args.threads,
            "batch_size": args.batch_size, "runs": runs, **compare(*rows)}  # fmt: skip


def markdown(result: dict) -> str:
    title = "Static vs continuous batching" if "runs" in result else "Two runs of one cell, case by case"
    lines = [f"# {title} (text-to-SQL runner)", "", f"Command: `{result['command']}`", ""]
    if "runs" in result:
        lines += [
            f"{result['model']}, {result['policy']} at B {result['budget']}, batch {result['batch_size']}, "
            f"{result['threads']} threads, first {result['cases']} test cases, one process, back to back.",
            "",
            "| batching | wall s | cases/s | speed-up | EX |",
            "|---|---:|---:|---:|---:|",
        ]
        for r in result["runs"]:
            lines.append(
                f"| {r['batching']} | {r['wall_s']} | {r['cases_per_s']} | {r.get('speedup', 1.0)}x | {r['ex']} |"
            )
        lines.append("")
    else:
        lines += [f"A: `{result['a']}`  ", f"B: `{result['b']}`", ""]
    lines.append(
        f"Identical outputs: {result['identical_outputs']}/{result['cases']}; same correctness: "
        f"{result['same_correctness']}/{result['cases']}; EX {result['ex'][0]} vs {result['ex'][1]}; "
        f"measured B {result['measured_b'][0]} vs {result['measured_b'][1]}; generated tokens "
        f"{result['generated_tokens'][0]} vs {result['generated_tokens'][1]}."
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("STATIC_DIR", "CONTINUOUS_DIR"))
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--policy", default="pask")
    ap.add_argument("--budget", type=float, default=0.4)
    ap.add_argument("--limit", type=int, default=120, help="the first N test cases")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill-store", type=Path)
    ap.add_argument("--name", help="results file name (default: from the arguments)")
    add_allow_dirty(ap)
    args = ap.parse_args()
    command = "python benchmarks/continuous_batching.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    check_clean(OUT, args.allow_dirty)
    if args.compare:
        a, b = args.compare
        result = {"command": command, "a": str(a), "b": str(b), **compare(_rows(a), _rows(b))}
        name = args.name or f"compare-{a.name}"
    else:
        result = {"command": command, **run_both(args)}
        name = args.name or f"{args.policy}-b{args.budget:g}-first{args.limit}"
    write_result(OUT / name, result, markdown(result), command=command, allow_dirty=args.allow_dirty)
    print(markdown(result))


if __name__ == "__main__":
    main()
