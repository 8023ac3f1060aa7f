"""Constrained decode steps with and without the masked LM head (``pask.runtime.masked_head``), A/B in one run.

    .venv/bin/python benchmarks/masked_head.py [--policy kivi-4] [--limit 4] [--batch-size 16] [--threads 2]

Decodes the first ``--limit`` dev cases of each non-live BFCL category as one batch, alternately
with ``PASK_MASKED_HEAD=0`` and ``1`` (``--repeats`` rounds; the best time per step of each is
kept), and reports time per decode step, the speed-up, whether every case's tokens are the same,
and how often a row took the narrow path. Also the share of steps by allowed-token count over the
same generations. Writes ``benchmarks/results/masked_head.{json,md}``.
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import shlex
import sys
from pathlib import Path

import torch

from pask.experiments.provenance import add_allow_dirty, check_clean, write_result

OUT = Path(__file__).resolve().parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--policy", default="kivi-4")
    ap.add_argument("--budget", type=float, default=0.33)
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    add_allow_dirty(ap)
    args = ap.parse_args()
    check_clean(OUT / "masked_head", args.allow_dirty)
    torch.set_num_threads(args.threads)

    from pask.evaluation.run_bfcl import prepare
    from pask.policies import get_policy
    from pask.runtime import masked_head
    from pask.runtime.engine import generate
    from pask.runtime.models import load_model
    from pask.structure.constraint import allocate_mask
    from pask.tasks.function_calling import load_cases

    lm = load_model(args.model, dtype=torch.bfloat16)
    cats = ["simple", "multiple", "parallel", "parallel_multiple"]
    cases = load_cases(cats, split="dev", limit=args.limit)[: args.batch_size]
    best: dict[str, float] = {}
    tokens: dict[str, list] = {}
    rows: dict[str, int] = {}
    real_close = masked_head.MaskedHead.close

    def close(self):
        rows["narrow"], rows["full"] = self.narrow_rows, self.full_rows
        real_close(self)

    masked_head.MaskedHead.close = close
    for _ in range(args.repeats):
        for flag in ("0", "1"):
            os.environ[masked_head.ENV] = flag
            reqs = [prepare(lm, c, args.max_new_tokens)[0] for c in cases]
            gens = generate(lm, reqs, policy=get_policy(args.policy, budget=args.budget))
            best[flag] = min(best.get(flag, float("inf")), gens[0].tpot_ms)
            tokens[flag] = [g.token_ids for g in gens]
    masked_head.MaskedHead.close = real_close

    widths: collections.Counter = collections.Counter()
    vocab = lm.model.config.vocab_size
    for c, ids in zip(cases, tokens["0"], strict=True):
        req = prepare(lm, c, args.max_new_tokens)[0]
        mask = allocate_mask(1, vocab)
        for t in ids:
            if req.constraint.is_done():
                break
            req.constraint.mask(mask, 0)
            n = int(((mask[0].reshape(-1, 1) >> torch.arange(32, dtype=torch.int32)) & 1).sum())
            widths["1" if n == 1 else "2-16" if n <= 16 else "17-1024" if n <= 1024 else ">1024"] += 1
            req.constraint.consume(t)
    steps = sum(widths.values())
    same = sum(a == b for a, b in zip(tokens["0"], tokens["1"], strict=True))
    res = {
        "command": shlex.join([sys.executable.split("/")[-1], *sys.argv]),
        "machine": platform.processor() or platform.machine(),
        "model": args.model,
        "policy": args.policy,
        "batch": len(cases),
        "threads": args.threads,
        "ms_per_step_off": round(best["0"], 1),
        "ms_per_step_on": round(best["1"], 1),
        "speedup": round(best["0"] / best["1"], 3),
        "same_tokens": f"{same}/{len(cases)}",
        "rows_narrow": rows.get("narrow", 0),
        "rows_full": rows.get("full", 0),
        "allowed_tokens_share": {k: round(v / steps, 3) for k, v in sorted(widths.items())},
    }
    md = [
        "# Masked LM head: constrained decode steps with and without it",
        "",
        f"`{res['command']}` ({res['machine']}, {args.model}, {args.policy} at B = {args.budget}, "
        f"batch {res['batch']}, {args.threads} threads)",
        "",
        "| head | ms / step |",
        "|---|---:|",
        f"| full (PASK_MASKED_HEAD=0) | {res['ms_per_step_off']} |",
        f"| masked | {res['ms_per_step_on']} |",
        "",
        f"Speed-up {res['speedup']}x; same tokens in {res['same_tokens']} cases; rows served narrow / "
        f"full: {res['rows_narrow']} / {res['rows_full']}.",
        "",
        "Share of decode steps by the number of tokens the grammar allows: "
        + ", ".join(f"{k}: {v:.1%}" for k, v in res["allowed_tokens_share"].items())
        + ".",
        "",
    ]
    write_result(OUT / "masked_head", res, "\n".join(md), command=res["command"], allow_dirty=args.allow_dirty)
    print("\n".join(md))


if __name__ == "__main__":
    main()
