"""Where a served decode step goes: `pask bench serve` with timers around the model's parts.

    .venv/bin/python benchmarks/serve_breakdown.py --out benchmarks/results/serving/breakdown-c16 -- \\
        --policies full,pask --budget 0.33 --table pask/tables/qwen2.5-coder-0.5b-bfcl-b0.33.json \\
        --concurrency 16 --input-len 8192 --output-len 64 --requests-per-client 1 --threads 2 \\
        --prefill-store ~/.cache/pask/serve-store

Everything after ``--`` goes to ``pask bench serve`` (its own results go to a scratch stem next to
``--out``). Wall-clock timers wrap the native attention call, every linear layer (PyTorch's or the
native GEMV), the LM head, the grammar masks (``plan_head``), token choice, the policy's decisions
(``decide_row``, and ``TieredCache.apply_many``, which applies a step's decisions of every row at
once) and measured budget (``row_budget``), the cache appends, RMSNorm and rotary
embedding; only scheduler steps that start and end with every client's request running (batch =
concurrency) count. Writes ``--out``.json / .md: milliseconds per step of each part, per policy.
The timers cost a little themselves (~170 linear calls per step): compare parts, not totals.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections import defaultdict
from pathlib import Path

from pask.errors import PaskError
from pask.experiments.provenance import add_allow_dirty, check_clean, write_result

PARTS = {
    "step": "scheduler step (all of it)",
    "forward": "model forward",
    "attention": "native decode attention",
    "linear": "linear layers (7 per layer)",
    "lm_head": "LM head (masked)",
    "plan_head": "grammar masks before the forward",
    "pick_tokens": "token choice",
    "decide_row": "policy decisions and INT4 moves",
    "row_budget": "measured budget per row",
    "cache_update": "cache appends",
    "rmsnorm": "RMSNorm",
    "rotary": "rotary embedding",
}


class Timers:
    """Per-policy sums of wall time per part, counted only inside full-batch steps."""

    def __init__(self) -> None:
        self.ms: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.steps: dict[str, int] = defaultdict(int)
        self.cur: dict[str, float] = defaultdict(float)  # the running step's parts
        self.policy: str | None = None
        self.on = False

    def wrap(self, part: str, fn):
        def timed(*a, **k):
            if not self.on:
                return fn(*a, **k)
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.cur[part] += (time.perf_counter() - t) * 1e3

        return timed


def install(timers: Timers, concurrency: int) -> None:
    """Wrap the parts (module attributes, so the scheduler and the model call the wrappers)."""
    import torch
    from transformers.models.qwen2 import modeling_qwen2 as mq

    from pask.cpu import bf16_matmul, native_norm, native_rotary, weights
    from pask.kv import cache, native_attention
    from pask.runtime import masked_head
    from pask.runtime import scheduler as sched

    native_attention.decode_layer = timers.wrap("attention", native_attention.decode_layer)
    torch.nn.Linear.forward = timers.wrap("linear", torch.nn.Linear.forward)
    bf16_matmul._bf16_forward = timers.wrap("linear", bf16_matmul._bf16_forward)  # before the model loads
    weights.QuantLinear.forward = timers.wrap("linear", weights.QuantLinear.forward)  # --weights int8 / int4
    masked_head.MaskedHead._forward = timers.wrap("lm_head", masked_head.MaskedHead._forward)
    sched.Scheduler._plan_head = timers.wrap("plan_head", sched.Scheduler._plan_head)
    for name in ("pick_tokens", "decide_row", "row_budget"):
        setattr(sched, name, timers.wrap(name, getattr(sched, name)))
    cache.TieredCache.update = timers.wrap("cache_update", cache.TieredCache.update)
    cache.TieredCache.apply_many = timers.wrap("decide_row", cache.TieredCache.apply_many)  # a step's moves
    mq.Qwen2RMSNorm.forward = timers.wrap("rmsnorm", mq.Qwen2RMSNorm.forward)
    native_norm.NativeRMSNorm.forward = timers.wrap("rmsnorm", native_norm.NativeRMSNorm.forward)
    native_rotary.install()  # before the timer wraps it (the model's load leaves an installed module as it is)
    mq.apply_rotary_pos_emb = timers.wrap("rotary", mq.apply_rotary_pos_emb)
    mq.Qwen2Model.forward = timers.wrap("forward", mq.Qwen2Model.forward)
    step = sched.Scheduler.step

    def timed_step(self) -> None:
        timers.policy = self.policy_name
        full = len(self.running) == concurrency and not self.waiting
        timers.on = full
        t = time.perf_counter()
        try:
            step(self)
        finally:
            timers.on = False
        if full and len(self.running) == concurrency:  # (a step where a request finished is dropped)
            timers.cur["step"] = (time.perf_counter() - t) * 1e3
            for part, ms in timers.cur.items():
                timers.ms[self.policy_name][part] += ms
            timers.steps[self.policy_name] += 1
        timers.cur.clear()

    sched.Scheduler.step = timed_step


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    add_allow_dirty(ap)
    if "--" not in argv:
        if {"-h", "--help"} & set(argv):
            ap.print_help()
            return 0
        print("usage: serve_breakdown.py --out STEM -- <pask bench serve options>", file=sys.stderr)
        return 2
    cut = argv.index("--")
    args = ap.parse_args(argv[:cut])
    bench = argv[cut + 1 :]
    if "--out" in bench or "--allow-dirty" in bench:
        print("give --out and --allow-dirty before `--` (the benchmark's own results go next to it)", file=sys.stderr)
        return 2
    try:
        check_clean(args.out, args.allow_dirty)
    except PaskError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.allow_dirty:
        bench.append("--allow-dirty")
    conc = 8
    if "--concurrency" in bench:
        conc = int(bench[bench.index("--concurrency") + 1])
    timers = Timers()
    install(timers, conc)
    from pask import cli

    scratch = args.out.with_name(args.out.name + "-bench")
    sys.argv = ["pask", "bench", "serve", *bench, "--out", str(scratch)]
    try:
        cli.main()
    except SystemExit as e:
        if e.code not in (0, None):
            return int(e.code) if isinstance(e.code, int) else 1
    per_step = {
        p: {part: round(ms / timers.steps[p], 2) for part, ms in parts.items()} for p, parts in timers.ms.items()
    }
    command = "python benchmarks/serve_breakdown.py " + shlex.join(argv)
    result = {"command": command, "concurrency": conc, "steps": dict(timers.steps), "ms_per_step": per_step}
    policies = list(per_step)
    lines = [
        f"# Served decode step at batch {conc}: milliseconds per step by part",
        "",
        f"Command: `{command}`",
        "",
        f"Steps at full batch: {', '.join(f'{p} {timers.steps[p]}' for p in policies)}. Parts overlap "
        "(the forward holds attention, linears, norms, rotary and the cache appends); timers add a little.",
        "",
        "| part | " + " | ".join(policies) + " |",
        "|---|" + "---:|" * len(policies),
    ]
    for part, label in PARTS.items():
        lines.append(f"| {label} | " + " | ".join(f"{per_step[p].get(part, 0.0):.2f}" for p in policies) + " |")
    write_result(args.out, result, "\n".join(lines) + "\n", command=command, allow_dirty=args.allow_dirty)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
