"""Why a copy breaks under eviction, token by token: teacher-forced RULER copy cases with and without KVFetch.

    .venv/bin/python benchmarks/kvfetch_copy_probe.py [--length 2048] [--cases 6] [--budget 0.2] [--split dev]

For each ``copy`` case of the RULER-style task (``pask.tasks.ruler``; dev split by default: a probe
of the method, not an evaluation), the model first decodes the case under Full KV; that output is
then forced, token by token, through each policy (``--policies``), and every step records whether
the policy's greedy token equals the forced one (the copy would go on), and, for the tokens the
output copies from the prompt (the prompt position the read pointer would be at), where the next
token's K/V sit: held (BF16 / INT4 / INT2), fetched into a slot, cold only, or released. Per policy:
the share of forced tokens it would also pick, over all steps and over the copied ones, and the
copied tokens' next-token tiers. Writes ``benchmarks/results/kvfetch_copy_probe.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections import Counter
from pathlib import Path

import torch

from pask.experiments.provenance import add_allow_dirty, check_clean, write_result
from pask.kv.actions import Action

OUT = Path(__file__).resolve().parent / "results"
TIERS = {int(Action.H): "held BF16", int(Action.L): "held INT4", int(Action.L2): "held INT2", int(Action.R): "released"}


def policy_for(spec: str, budget: float):
    """``snapkv`` / ``fetch-snapkv`` / ``fetch-snapkv:cold_bits=4+cold_share=0.7`` ...: SnapKV (window 32)
    at ``budget``, with KVFetch and its options (JSON values) where named."""
    from pask.policies import SnapKVPolicy
    from pask.policies.kvfetch import FetchPolicy

    name, _, opts = spec.partition(":")
    kw = {k: json.loads(v) for k, v in (o.split("=") for o in opts.split("+") if o)}
    inner = SnapKVPolicy(budget, window=32)
    if name == "snapkv":
        return inner
    if name == "fetch-snapkv":
        return FetchPolicy(inner, **kw)
    raise SystemExit(f"unknown policy spec {spec!r} (snapkv, fetch-snapkv[:key=value+...])")


def probe(model, prompt: list[int], forced: list[int], policy) -> dict:
    """Force ``forced`` after ``prompt`` under ``policy``; per step: greedy == forced, and for copied
    tokens the tier (or fetch slot / cold copy) of the prompt position that comes next."""
    from pask.runtime.runner import decode_with_policy

    index: dict[int, list[int]] = {}
    for i, t in enumerate(prompt):
        index.setdefault(t, []).append(i)
    steps: list[dict] = []
    state = {"cache": None}

    def choose(row: int, logits: torch.Tensor) -> int:
        i = len(steps)
        want = forced[i] if i < len(forced) else forced[-1]
        rec = {"agree": int(logits.argmax()) == want}
        # the prompt position a copy would read next: after a run matching the forced tokens so far
        if i >= 1 and state["cache"] is not None:
            prev = forced[i - 1]
            nxt = [p + 1 for p in index.get(prev, []) if p + 1 < len(prompt) and prompt[p + 1] == want]
            if nxt:
                p = nxt[0]
                cache = state["cache"]
                tier = int(cache.tiers(0, 0)[p])
                ix = cache.index(0, 0)
                where = TIERS[tier]
                if p in ix.fetched:
                    where = "fetched"
                elif tier == int(Action.R) and ix.cold_n and p < ix.cold_slot.t.numel() and int(ix.cold_slot.t[p]) >= 0:
                    where = "cold only"
                rec["copied"], rec["next_at"] = True, where
        steps.append(rec)
        return want

    from pask.runtime import scheduler as sched

    real_step = sched.Scheduler.step

    def step(self, *a, **k):  # keep a handle on the running cache
        out = real_step(self, *a, **k)
        state["cache"] = self.cache
        return out

    sched.Scheduler.step = step
    try:
        decode_with_policy(model, [prompt], policy, len(forced), None, choose)
    finally:
        sched.Scheduler.step = real_step
    copied = [s for s in steps if s.get("copied")]
    return {
        "agree": sum(s["agree"] for s in steps) / max(len(steps), 1),
        "agree_copied": sum(s["agree"] for s in copied) / max(len(copied), 1),
        "copied": len(copied),
        "steps": len(steps),
        "next_at": dict(Counter(s["next_at"] for s in copied)),
        "agree_by_place": {
            w: sum(s["agree"] for s in copied if s["next_at"] == w) / n
            for w, n in Counter(s["next_at"] for s in copied).items()
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--cases", type=int, default=6)
    ap.add_argument("--split", default="dev", choices=("calibration", "dev"))
    ap.add_argument("--budget", type=float, default=0.2)
    ap.add_argument("--policies", default="snapkv,fetch-snapkv,fetch-snapkv:cold_bits=4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=OUT / "kvfetch_copy_probe")
    add_allow_dirty(ap)
    args = ap.parse_args(argv)
    check_clean(args.out, args.allow_dirty)
    if args.cases < 1 or args.threads < 1 or not 0.0 < args.budget <= 1.0:
        ap.error("--cases and --threads must be >= 1, --budget in (0, 1]")
    torch.set_num_threads(args.threads)
    from pask.policies import FullPolicy
    from pask.runtime.models import load_model
    from pask.runtime.runner import decode_with_policy
    from pask.tasks import get_task

    lm = load_model("qwen2.5-coder-0.5b", dtype=torch.bfloat16)
    task = get_task("ruler")
    opts = task.resolve_options({"tasks": ["copy"], "length": args.length})
    cases = task.cases(args.split, args.cases, **opts)
    specs = [s for s in args.policies.split(",") if s]
    rows = []
    for case in cases[: args.cases]:
        req = task.request(case, lm.tokenizer, tagging=False, **opts)
        stop = [lm.tokenizer.eos_token_id]
        ref = decode_with_policy(lm.model, [req.prompt_ids], FullPolicy(), 400, None, stop_token_ids=stop)
        forced = ref.tokens[0]
        row = {"id": case.id, "variant": case.variant, "forced_tokens": len(forced), "policies": {}}
        for spec in specs:
            row["policies"][spec] = probe(lm.model, req.prompt_ids, forced, policy_for(spec, args.budget))
            got = row["policies"][spec]
            print(case.id, spec, {k: got[k] for k in ("agree", "agree_copied", "next_at")}, flush=True)
        rows.append(row)
    command = "python benchmarks/kvfetch_copy_probe.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    result = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "rows": rows}
    result["command"] = command.strip()
    md = [
        "# Teacher-forced RULER copies: where the next copied token sits, and whether the policy would copy it",
        "",
        f"Command: `{result['command']}`",
        "",
        f"qwen2.5-coder-0.5b, bf16, {len(rows)} `copy` cases of the {args.split} split at {args.length} tokens; "
        f"the Full KV output forced through SnapKV (window 32) at B = {args.budget} with and without KVFetch.",
        "",
        "| case | variant | policy | agree, all steps | agree, copied steps | copied steps | next token's K/V |",
        "|---|---|---|---:|---:|---:|---|",
    ]
    for r in rows:
        for spec, p in r["policies"].items():
            where = ", ".join(f"{k} {v}" for k, v in sorted(p["next_at"].items()))
            md.append(
                f"| {r['id']} | {r['variant']} | {spec} | {100 * p['agree']:.1f} % | {100 * p['agree_copied']:.1f} % "
                f"| {p['copied']} | {where} |"
            )
    write_result(args.out, result, "\n".join(md) + "\n", command=result["command"], allow_dirty=args.allow_dirty)
    return 0


if __name__ == "__main__":
    sys.exit(main())
