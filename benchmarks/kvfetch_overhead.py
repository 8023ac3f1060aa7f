"""KVFetch's cost per decode step: the inner policy alone, the channel dormant, the channel active.

    .venv/bin/python benchmarks/kvfetch_overhead.py [--length 8192] [--steps 48] [--budget 0.2] [--threads 2]
        [--iso hot]

qwen2.5-coder-0.5b (bf16), one row of ``--length`` random prompt tokens, decoded ``--steps`` steps with
scripted tokens (the logits are ignored, so every run does the same work):

* ``inner``: SnapKV at ``--budget`` (window 16), the tokens not in the prompt;
* ``dormant``: ``fetch-snapkv`` at the same budget, the same tokens (the pointer never fires); with
  ``--iso hot`` (default) it holds SnapKV's hot set exactly, so the difference is the channel's own
  cost (with ``total`` its hot set is smaller by the cold share, which makes attention cheaper);
* ``active``: ``fetch-snapkv``, the tokens of a prompt span (a verbatim copy: the pointer fires and
  the fetch slots slide every step).

Per run: the median time between two consecutive token choices (one decode step: the forward,
the policy's decision, the bookkeeping) and the median time of the policy's ``step_actions``
(wrapped). Runs interleave over ``--repeats``; medians across repeats. The issue's target: the
dormant channel costs <= 3 % of the decode step. Writes ``benchmarks/results/kvfetch_overhead.{json,md}``.
"""

from __future__ import annotations

import argparse
import itertools
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from pask.experiments.provenance import add_allow_dirty, check_clean, write_result
from pask.kv.cache import CacheConfig
from pask.policies import SnapKVPolicy
from pask.policies.kvfetch import FetchPolicy

OUT = Path(__file__).resolve().parent / "results"


class Timed:
    """A policy whose ``step_actions`` is timed (everything else passes through)."""

    def __init__(self, policy):
        self.policy, self.times = policy, []

    def __getattr__(self, name):
        return getattr(self.policy, name)

    def step_actions(self, ctx):
        t = time.perf_counter()
        out = self.policy.step_actions(ctx)
        self.times.append(time.perf_counter() - t)
        return out


def run(model, prompt: list[int], script: list[int], policy) -> dict:
    """Decode ``script`` after ``prompt``; medians of the step time and of the decision time (ms)."""
    from pask.runtime.runner import decode_with_policy

    stamps: list[float] = []
    tokens = iter(script)

    def choose(row: int, logits: torch.Tensor) -> int:
        stamps.append(time.perf_counter())
        return next(tokens)

    timed = Timed(policy)
    decode_with_policy(model, [prompt], timed, len(script), CacheConfig(), choose)
    steps = [b - a for a, b in itertools.pairwise(stamps[1:])]  # skip the prefill and the first step
    return {"step_ms": statistics.median(steps) * 1e3, "decide_ms": statistics.median(timed.times[1:]) * 1e3}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--budget", type=float, default=0.2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--iso",
        choices=("hot", "total"),
        default="hot",
        help="KVFetch's accounting: hot (default; the dormant channel keeps SnapKV's hot set, so the "
        "difference is the channel's own cost) or total (its hot set is smaller by the cold share)",
    )
    ap.add_argument("--out", type=Path, default=OUT / "kvfetch_overhead")
    add_allow_dirty(ap)
    args = ap.parse_args(argv)
    check_clean(args.out, args.allow_dirty)
    if min(args.steps, args.repeats, args.threads) < 1 or args.steps < 4:
        ap.error("--steps must be >= 4; --repeats and --threads >= 1")
    if args.length < 4 * args.steps or args.length < 256:
        ap.error("--length must be >= 256 and >= 4 x --steps")
    if not 0.0 < args.budget <= 1.0:
        ap.error("--budget must be in (0, 1]")
    torch.set_num_threads(args.threads)
    from pask.runtime.models import load_model

    lm = load_model("qwen2.5-coder-0.5b", dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1000, 50000, (args.length,), generator=g).tolist()
    start = args.length // 2
    copy = prompt[start : start + args.steps]
    other = torch.randint(60000, 150000, (args.steps,), generator=g).tolist()  # ids the prompt lacks

    def snapkv():
        return SnapKVPolicy(args.budget, window=16)

    runs = {
        "inner": lambda: (snapkv(), other),
        "dormant": lambda: (FetchPolicy(snapkv(), slots=32, cold_share=0.5, iso=args.iso), other),
        "active": lambda: (FetchPolicy(snapkv(), slots=32, cold_share=0.5, iso=args.iso), copy),
    }
    times: dict[str, list[dict]] = {k: [] for k in runs}
    fired = {}
    for rep in range(args.repeats):
        for name, make in runs.items():
            policy, script = make()
            times[name].append(run(lm.model, prompt, script, policy))
            if isinstance(policy, FetchPolicy):
                fired[name] = policy.stats()
            print(f"repeat {rep}: {name} {times[name][-1]}", flush=True)
    rows = []
    base = statistics.median(t["step_ms"] for t in times["inner"])
    for name in runs:
        step = statistics.median(t["step_ms"] for t in times[name])
        decide = statistics.median(t["decide_ms"] for t in times[name])
        rows.append(
            {
                "run": name,
                "step_ms": round(step, 2),
                "decide_ms": round(decide, 3),
                "vs_inner": round(step / base - 1.0, 4),
                "channel": fired.get(name),
            }
        )
    command = "python benchmarks/kvfetch_overhead.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    result = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "rows": rows}
    result["command"] = command.strip()
    md = [
        "# KVFetch's cost per decode step",
        "",
        f"Command: `{result['command']}`",
        "",
        f"qwen2.5-coder-0.5b, bf16, one row of {args.length} random prompt tokens, {args.steps} scripted steps, "
        f"SnapKV (window 16) at B = {args.budget} with and without KVFetch (32 slots, cold share 0.5, "
        f"iso = {args.iso}), "
        f"{args.threads} thread(s); medians over {args.repeats} interleaved repeats. Step: between two "
        "consecutive token choices (forward + decision + bookkeeping); decide: the policy's `step_actions`.",
        "",
        "| run | step ms | decide ms | step vs inner | pointer fires | tokens fetched |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ch = r["channel"] or {}
        md.append(
            f"| {r['run']} | {r['step_ms']:.1f} | {r['decide_ms']:.3f} | {100 * r['vs_inner']:+.1f} % | "
            f"{ch.get('fires', '-')} | {ch.get('fetched', '-')} |"
        )
    write_result(args.out, result, "\n".join(md) + "\n", command=result["command"], allow_dirty=args.allow_dirty)
    return 0


if __name__ == "__main__":
    sys.exit(main())
