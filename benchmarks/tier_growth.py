"""Decode appends to one Full KV (all-BF16) row of a long prompt: the step that doubles its tier.

    .venv/bin/python benchmarks/tier_growth.py [--tokens 8188] [--steps 8] [--threads 1]

Qwen2.5-Coder-0.5B's KV layout (24 layers, 2 KV heads, head_dim 64, bf16), random K/V: one prefill
append of ``--tokens`` slots per layer, then ``--steps`` single-token appends, timed per step, with
the tier's first allocation as before (``headroom = 0``: doubling from ``initial_capacity``) and
with the serving headroom (:data:`pask.runtime.scheduler.SERVE_HEADROOM`). Writes
``benchmarks/results/tier_growth.{json,md}`` with the command.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from pask.experiments.provenance import add_allow_dirty, check_clean, write_result
from pask.kv.cache import CacheConfig, TieredCache
from pask.runtime.scheduler import SERVE_HEADROOM

OUT = Path(__file__).resolve().parent / "results"
QWEN_05B = SimpleNamespace(
    num_hidden_layers=24, num_key_value_heads=2, head_dim=64, hidden_size=896, num_attention_heads=14
)


def run(tokens: int, steps: int, headroom: int) -> dict:
    cache = TieredCache(QWEN_05B, CacheConfig(headroom=headroom), batch_size=1)
    layers = QWEN_05B.num_hidden_layers
    for layer in range(layers):
        k = torch.randn(1, 2, tokens, 64, dtype=torch.bfloat16)
        cache.update(k, k.clone(), layer)
    copied0, ms = cache.stats.copied_bytes, []
    for _ in range(steps):
        kv = [torch.randn(1, 2, 1, 64, dtype=torch.bfloat16) for _ in range(layers)]
        t0 = time.perf_counter()
        for layer in range(layers):
            cache.update(kv[layer], kv[layer].clone(), layer)
        ms.append((time.perf_counter() - t0) * 1e3)
    return {
        "headroom": headroom,
        "step_ms": [round(m, 2) for m in ms],
        "max_step_ms": round(max(ms), 2),
        "median_step_ms": round(sorted(ms)[len(ms) // 2], 2),
        "copied_bytes_in_decode": cache.stats.copied_bytes - copied0,
        "capacity": cache.layers[0].seqs[0].h.cap,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8188, help="prompt tokens (the 8k serving bench: 8188)")
    ap.add_argument("--steps", type=int, default=8, help="decode appends to time")
    ap.add_argument("--threads", type=int, default=1)
    add_allow_dirty(ap)
    args = ap.parse_args()
    if args.tokens < 1 or args.steps < 1 or args.threads < 1:
        raise SystemExit("--tokens, --steps and --threads must be >= 1")
    check_clean(OUT / "tier_growth", args.allow_dirty)
    torch.set_num_threads(args.threads)
    rows = [run(args.tokens, args.steps, h) for h in (0, SERVE_HEADROOM)]
    command = " ".join(["python benchmarks/tier_growth.py", *map(shlex.quote, sys.argv[1:])])
    params = {k: v for k, v in vars(args).items() if k != "allow_dirty"}
    lines = [
        f"# Decode appends to one {args.tokens}-token Full KV row (qwen2.5-coder-0.5b layout, bf16)",
        "",
        f"Command: `{command}`",
        "",
        "| first allocation | capacity after | max step ms | median step ms | bytes copied in decode |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        name = "doubling (headroom 0)" if r["headroom"] == 0 else f"headroom {r['headroom']}"
        lines.append(
            f"| {name} | {r['capacity']} | {r['max_step_ms']:.1f} | {r['median_step_ms']:.1f} | "
            f"{r['copied_bytes_in_decode']:,} |"
        )
    data = {"command": command, **params, "rows": rows}
    write_result(OUT / "tier_growth", data, "\n".join(lines) + "\n", command=command, allow_dirty=args.allow_dirty)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
