"""Low-bit KV: INT4 keys with and without per-channel balancing, and the INT2 tier: attention-output error.

    .venv/bin/python benchmarks/key_balance.py [--cases 4] [--tokens 24] [--threads 2]

Real BFCL dev prompts on qwen2.5-coder-0.5b (bf16). Each case is decoded once with Full KV on the
tiered cache (every token H); its generated tokens are then replayed (teacher forcing) with every
token outside the recent window moved to the L tier: INT4 with plain per-token keys, INT4 with
the per-channel key balance (``CacheConfig.key_balance``), and INT2 with the balance (the tier
KIVI-2 uses: every token in the INT2 tier). For each decode step and layer the relative L2 error of
the attention output (input of ``o_proj``) against the all-H replay is averaged. Writes
``benchmarks/results/key_balance.{json,md}``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import torch

from pask.calibration.distortion import DistortionSum, forced_capture
from pask.evaluation.run_bfcl import prepare
from pask.experiments.provenance import add_allow_dirty, check_clean, write_result
from pask.kv.cache import CacheConfig
from pask.policies import get_policy
from pask.runtime.engine import generate
from pask.runtime.models import load_model
from pask.tasks.function_calling import NON_LIVE, load_cases

OUT = Path(__file__).resolve().parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--cases", type=int, default=1, help="dev cases per non-live category")
    ap.add_argument("--tokens", type=int, default=24, help="generated tokens replayed per case")
    ap.add_argument("--threads", type=int, default=2)
    add_allow_dirty(ap)
    args = ap.parse_args()
    check_clean(OUT / "key_balance", args.allow_dirty)
    torch.set_num_threads(args.threads)
    lm = load_model(args.model)
    cases = load_cases(list(NON_LIVE), split="dev", limit=args.cases)
    reqs = [prepare(lm, c, args.tokens)[0] for c in cases]
    gens = generate(lm, reqs, policy=get_policy("full"))
    prompts = [r.prompt_ids for r in reqs]
    forced = [g.token_ids[: args.tokens] for g in gens]
    no_tags = [[] for _ in cases]
    labels = [None for _ in cases]
    all_low = {
        4: get_policy("static_mix", h=0.0, l=1.0, r=0.0),
        2: get_policy("static_mix", h=0.0, l=0.0, r=0.0, l2=1.0),
    }
    ref = forced_capture(lm.model, prompts, forced, get_policy("full"), no_tags, labels, CacheConfig())
    rows = {}
    variants = (("per-token INT4 keys", False, 4), ("balanced INT4 keys", True, 4), ("balanced INT2 (KIVI-2)", True, 2))
    for name, balanced, bits in variants:
        acc = DistortionSum(lm.num_layers)
        cfg = CacheConfig(key_balance=balanced)
        replay = forced_capture(lm.model, prompts, forced, all_low[bits], no_tags, labels, cfg)
        for p, f in zip(replay, ref, strict=True):
            acc.add(p, f)
        rows[name] = (acc.err / max(acc.steps, 1)).tolist()
    command = "python benchmarks/key_balance.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    result = {"command": command, "model": lm.name, "cases": [c.id for c in cases], "tokens": args.tokens, **rows}
    names = list(rows)
    lines = [
        f"# Low-bit KV: INT4 keys per token vs per-channel balanced, and INT2 ({lm.name}, bf16)",
        "",
        f"Command: `{command}`  ",
        f"{len(cases)} BFCL dev cases ({', '.join(c.id for c in cases)}); every token outside the recent "
        f"window in a low tier (INT4, or INT2 in the last column; values per token in every column), {args.tokens} "
        "generated tokens replayed. Relative L2 error of each layer's attention output against the all-BF16 "
        "replay, mean over decode steps.",
        "",
        "| layer | " + " | ".join(names) + " |",
        "|---:|" + "---:|" * len(names),
    ]
    for i in range(lm.num_layers):
        lines.append(f"| {i} | " + " | ".join(f"{rows[n][i]:.3f}" for n in names) + " |")
    lines.append("| mean | " + " | ".join(f"{sum(rows[n]) / len(rows[n]):.3f}" for n in names) + " |")
    write_result(OUT / "key_balance", result, "\n".join(lines) + "\n", command=command, allow_dirty=args.allow_dirty)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
