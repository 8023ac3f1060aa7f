"""Batch invariance on the real model: the same case, the same output, whatever the batching.

    .venv/bin/python benchmarks/batch_invariance.py [--tasks sql,bfcl] [--policies full,pask] \
        [--modes static-1,static-8,static-16,continuous-8,continuous-16] [--limit 100] \
        [--threads 2] [--work DIR] [--prefill-store DIR]

For each task and policy it runs ``pask eval`` on the first ``--limit`` test cases (BFCL: the
first ``limit / 4`` of each of the four non-live categories) once per batching mode (``static-N``:
static batches of N, ``continuous-N``: continuous batching with N rows), bf16, and compares every
mode's outputs with batch 1 (``static-1``, each case alone): identical outputs (text, generated
token count and measured B), and the accuracy of each mode. PASK runs with the committed tables
(BFCL at B 0.33, text-to-SQL at B 0.4). The cells live under ``--work`` (default
``~/.cache/pask/batch-invariance``) and resume there. Results:
``benchmarks/results/batch-invariance/<name>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

from pask.experiments.provenance import add_allow_dirty, check_clean, write_result

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "batch-invariance"
MODEL = "qwen2.5-coder-0.5b"
PASK_BUDGET = {"bfcl": 0.33, "sql": 0.4}


def cell_args(task: str, policy: str, mode: str, limit: int, threads: int) -> list[str]:
    """The ``pask eval`` arguments of one cell."""
    batching, size = mode.split("-")
    args = [task, "--split", "test", "--batch-size", size, "--batching", batching, "--threads", str(threads)]
    args += ["--limit", str(limit // 4 if task == "bfcl" else limit)]
    if policy == "pask":
        b = PASK_BUDGET[task]
        args += ["--policy", "pask", "--budget", f"{b:g}", "--table", f"pask/tables/{MODEL}-{task}-b{b:g}.json"]
    elif policy != "full":
        raise SystemExit(f"--policies: full or pask, got {policy!r}")
    return args


def run_cell(task: str, policy: str, mode: str, args, work: Path) -> Path:
    """Run (or resume) one cell; return its directory."""
    out = work / f"{task}-{policy}-{mode}"
    if (out / "summary.json").exists():
        return out
    cmd = [sys.executable, "-m", "pask.cli", "eval", *cell_args(task, policy, mode, args.limit, args.threads)]
    cmd += ["--out", str(out)] + (["--prefill-store", str(args.prefill_store)] if args.prefill_store else [])
    print("$", shlex.join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    return out


def _rows(d: Path) -> dict[str, dict]:
    from pask.evaluation.case_rows import read_done

    return read_done(d / "cases.jsonl")


def _b(row: dict) -> float | None:
    return (row.get("budget") or {}).get("b_total")


def compare(ref: dict[str, dict], other: dict[str, dict]) -> dict:
    """Identical outputs (text, token count, measured B) over the shared ids, and each side's accuracy."""
    ids = sorted(set(ref) & set(other))
    key = ("output", "n_generated")
    same = [i for i in ids if all(ref[i][k] == other[i][k] for k in key)]
    diff = [i for i in ids if i not in set(same)]
    return {
        "cases": len(ids),
        "identical": len(same),
        "same_b": sum(_b(ref[i]) == _b(other[i]) for i in ids),
        "different_ids": diff,
        "correct": sum(bool(other[i]["correct"]) for i in ids),
        "correct_ref": sum(bool(ref[i]["correct"]) for i in ids),
    }


def markdown(result: dict) -> str:
    lines = [
        "# Batch invariance on the real model",
        "",
        f"Command: `{result['command']}`",
        "",
        f"{result['model']}, bf16, first {result['limit']} test cases per task (BFCL: {result['limit'] // 4} "
        "per non-live category). Each mode against batch 1 (every case alone): cases with identical "
        "outputs (text and generated token count), cases with the same measured B, correct cases.",
        "",
        "| task | policy | mode | identical to batch 1 | same B | correct (batch 1) | differing ids |",
        "|---|---|---|---:|---:|---:|---|",
    ]
    for c in result["cells"]:
        cmp = c["vs_batch1"]
        ids = ", ".join(cmp["different_ids"][:6]) + (" ..." if len(cmp["different_ids"]) > 6 else "")
        lines.append(
            f"| {c['task']} | {c['policy']} | {c['mode']} | {cmp['identical']}/{cmp['cases']} | "
            f"{cmp['same_b']}/{cmp['cases']} | {cmp['correct']} ({cmp['correct_ref']}) | {ids} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default="sql,bfcl")
    ap.add_argument("--policies", default="full,pask")
    ap.add_argument("--modes", default="static-1,static-8,static-16,continuous-8,continuous-16")
    ap.add_argument("--limit", type=int, default=100, help="the first N test cases of each task")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache" / "pask" / "batch-invariance")
    ap.add_argument("--prefill-store", type=Path)
    ap.add_argument("--name", default=None, help="results file name (default: first<limit>)")
    add_allow_dirty(ap)
    args = ap.parse_args()
    command = "python benchmarks/batch_invariance.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    check_clean(OUT, args.allow_dirty)
    modes = args.modes.split(",")
    if modes[0] != "static-1":
        modes = ["static-1", *[m for m in modes if m != "static-1"]]
    for m in modes:
        kind, _, size = m.partition("-")
        if kind not in ("static", "continuous") or not size.isdigit():
            raise SystemExit(f"--modes: static-N or continuous-N, got {m!r}")
    cells = []
    for task in args.tasks.split(","):
        for policy in args.policies.split(","):
            dirs = {m: run_cell(task, policy, m, args, args.work) for m in modes}
            ref = _rows(dirs["static-1"])
            for m in modes[1:]:
                cells.append({"task": task, "policy": policy, "mode": m, "vs_batch1": compare(ref, _rows(dirs[m]))})
                print(json.dumps(cells[-1]), flush=True)
    result = {"command": command, "model": MODEL, "limit": args.limit, "threads": args.threads, "cells": cells}
    write_result(OUT / (args.name or f"first{args.limit}"), result, markdown(result), command=command,
                 allow_dirty=args.allow_dirty)  # fmt: skip
    print(markdown(result))


if __name__ == "__main__":
    main()
