"""Decode-step cost of the scope check (issue 28), at batch 1 and batch 16, in one run.

    .venv/bin/python benchmarks/sql_scope_overhead.py [--cases 16] [--threads 2] [--name NAME]

``--cases`` cases spread evenly over the SQL test split are decoded with Full KV and the scope check on
(``--sql-scope on``): once one request at a time, once in static batches of 16. For each, the
decode time (each batch's wall time minus its prefill) and the time the scope masks took
(``ScopedConstraint.seconds``, summed over rows: the masks are filled one row after another in the
decode thread) are measured on the same tokens. The overhead is ``scope / (decode - scope)``: the
share the check adds to a decode step. The same requests are also decoded with the check off, in
the same run, for the TPOT ratio on / off (informational only: the outputs, and so the steps,
differ). Results: ``benchmarks/results/sql-scope/<name>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import torch

from pask.evaluation.runner import prepare
from pask.experiments.provenance import add_allow_dirty, check_clean, write_result
from pask.runtime.engine import generate
from pask.runtime.models import load_model
from pask.tasks.registry import get_task

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "sql-scope"


def decode(lm, task, cases, scope: str, batch: int, max_new_tokens: int) -> dict:
    """Decode ``cases`` in batches of ``batch``; decode and scope seconds, steps, tokens."""
    reqs = []
    for c in cases:
        req, err = prepare(task, lm, c, max_new_tokens, sql_scope=scope)
        if err is not None:
            raise SystemExit(f"error: case {c.id}: {err}")
        reqs.append(req)
    decode_s = steps = tokens = 0.0
    for i in range(0, len(reqs), batch):
        chunk = reqs[i : i + batch]
        t0 = time.perf_counter()
        gens = generate(lm, chunk)
        wall = time.perf_counter() - t0
        decode_s += wall - sum(g.prefill_ms for g in gens) / 1000  # each prompt is prefilled alone
        steps += max(len(g.token_ids) for g in gens)
        tokens += sum(len(g.token_ids) for g in gens)
    scope_s = sum(getattr(r.constraint, "seconds", 0.0) for r in reqs)
    return {
        "decode_s": round(decode_s, 3),
        "scope_s": round(scope_s, 4),
        "steps": int(steps),
        "tokens": int(tokens),
        "step_ms": round(1000 * decode_s / steps, 3),
        "scope_ms_per_step": round(1000 * scope_s / steps, 4),
        "scope_ms_per_row_step": round(1000 * scope_s / tokens, 4),
        "overhead": round(scope_s / (decode_s - scope_s), 5) if scope == "on" else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--cases", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--name", default="overhead")
    add_allow_dirty(ap)
    args = ap.parse_args()
    if args.cases < 1 or args.threads < 1 or args.max_new_tokens < 1:
        ap.error("--cases, --threads and --max-new-tokens must be >= 1")
    check_clean(OUT / args.name, args.allow_dirty)
    torch.set_num_threads(args.threads)
    task = get_task("sql")
    split = task.cases("test")
    cases = split[:: max(1, len(split) // args.cases)][: args.cases]  # spread over the split's databases
    lm = load_model(args.model, dtype=torch.bfloat16)
    decode(lm, task, cases[:2], "on", 2, 8)  # warm-up: kernels, grammars, the token classes
    rows = []
    for batch in (1, 16):
        for scope in ("off", "on"):
            r = decode(lm, task, cases, scope, batch, args.max_new_tokens)
            rows.append({"batch": batch, "scope": scope, **r})
            print(rows[-1], flush=True)
    ratio = {
        b: round(
            next(r for r in rows if r["batch"] == b and r["scope"] == "on")["step_ms"]
            / next(r for r in rows if r["batch"] == b and r["scope"] == "off")["step_ms"],
            4,
        )
        for b in (1, 16)
    }
    # a full batch of rows mid-query: every row pays the per-row cost, against the mean step of the
    # off run (fewer live rows, so shorter: the bound errs high)
    full = {}
    for b in (1, 16):
        on = next(r for r in rows if r["batch"] == b and r["scope"] == "on")
        off = next(r for r in rows if r["batch"] == b and r["scope"] == "off")
        full[b] = round(b * on["scope_ms_per_row_step"] / off["step_ms"], 5)
    result = {
        "model": args.model,
        "dtype": "bf16",
        "policy": "full",
        "cases": len(cases),
        "threads": args.threads,
        "rows": rows,
        "step_ratio_on_off": ratio,
        "full_batch_bound": full,
    }
    command = shlex.join(["python", "benchmarks/sql_scope_overhead.py", *sys.argv[1:]])
    md = markdown(result, command)
    js, _ = write_result(OUT / args.name, result, md, command=command, allow_dirty=args.allow_dirty)
    print(md, end="")
    print(f"results: {js}")


def markdown(r: dict, command: str) -> str:
    lines = [
        "# Decode-step cost of the scope check",
        "",
        f"Command: `{command}`",
        "",
        f"{r['cases']} cases spread over the SQL test split, {r['model']} {r['dtype']}, Full KV, "
        f"{r['threads']} threads, static batches. Overhead: the scope masks' time over the rest of the "
        "decode time, on the same tokens.",
        "",
        "| batch | scope | steps | tokens | decode s | step ms | scope ms / step | scope ms / row-step | overhead |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for x in r["rows"]:
        ov = "-" if x["overhead"] is None else f"{100 * x['overhead']:.2f} %"
        lines.append(
            f"| {x['batch']} | {x['scope']} | {x['steps']} | {x['tokens']} | {x['decode_s']} | {x['step_ms']} "
            f"| {x['scope_ms_per_step']} | {x['scope_ms_per_row_step']} | {ov} |"
        )
    lines += [
        "",
        "Step time on / off (informational: with the check on, the outputs and so the steps differ): "
        + ", ".join(f"batch {b}: {v}" for b, v in r["step_ratio_on_off"].items())
        + ".",
        "",
        "Bound for a batch whose every row is mid-query (batch x scope ms per row-step / the off run's mean "
        "step, which had fewer live rows and so errs high): "
        + ", ".join(f"batch {b}: {100 * v:.2f} %" for b, v in r["full_batch_bound"].items())
        + ".",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
