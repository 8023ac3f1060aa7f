"""The decode linears of a model on the native bf16 GEMV, weights read from DRAM, outside the server.

    .venv/bin/python benchmarks/gemv_stream.py [--model qwen2.5-coder-0.5b] [--rows 2,6,16] [--copies 4] [--threads 2]

Takes the shapes of every ``nn.Linear`` of the model's decoder layers (not the LM head), allocates
``--copies`` sets of random bf16 weights of those shapes (so that a pass does not find them in the
last-level cache) and times passes over one set after another with :func:`pask.cpu.native_gemv.linear_bf16`
at each batch size (rows), as a decode step calls them. Reports milliseconds per model pass and the
weight bytes read per second. Compare with the "linear layers" part of
``benchmarks/serve_breakdown.py`` to see what the server adds. Writes
``benchmarks/results/gemv_stream.{json,md}``.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from pask.cpu import native_gemv
from pask.errors import PaskError
from pask.experiments.provenance import add_allow_dirty, check_clean, write_result
from pask.runtime.models import load_model

OUT = Path(__file__).resolve().parent / "results" / "gemv_stream"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--rows", default="2,6,16", help="comma-separated batch sizes (at most 16)")
    ap.add_argument("--copies", type=int, default=4, help="weight sets cycled through (beat the cache)")
    ap.add_argument("--passes", type=int, default=12, help="timed passes per batch size")
    ap.add_argument("--threads", type=int, default=2)
    add_allow_dirty(ap)
    args = ap.parse_args()
    check_clean(OUT, args.allow_dirty)
    rows = [int(r) for r in args.rows.split(",")]
    if any(not 1 <= r <= native_gemv.MAX_ROWS for r in rows) or args.copies < 1 or args.passes < 1:
        raise SystemExit(f"--rows must lie in 1..{native_gemv.MAX_ROWS}; --copies and --passes >= 1")
    torch.set_num_threads(args.threads)
    if not (native_gemv.available() and native_gemv.has_bf16_io()):
        raise PaskError(f"the native bf16 GEMV does not run here ({native_gemv.status()})")
    lm = load_model(args.model)
    layers = lm.model.model.layers
    shapes = [
        (m.out_features, m.in_features, m.bias is not None) for m in layers.modules() if isinstance(m, torch.nn.Linear)
    ]
    model_name = lm.name
    del lm
    gen = torch.Generator().manual_seed(0)
    sets = [
        [
            (torch.randn(n, k, generator=gen).bfloat16(), torch.randn(n, generator=gen).bfloat16() if b else None)
            for n, k, b in shapes
        ]
        for _ in range(args.copies)
    ]
    nbytes = sum(n * k * 2 for n, k, _ in shapes)
    res = {}
    for m in rows:
        xs = {k: torch.randn(m, k, generator=gen).bfloat16() for _, k, _ in shapes}
        times = []
        for p in range(args.passes + args.copies):  # the first round over the copies is warm-up
            t = time.perf_counter()
            for w, b in sets[p % args.copies]:
                native_gemv.linear_bf16(xs[w.shape[1]], w, b)
            if p >= args.copies:
                times.append(time.perf_counter() - t)
        ms = 1e3 * statistics.median(times)
        res[m] = {"ms": ms, "gb_s": nbytes / ms / 1e6}
    command = "python benchmarks/gemv_stream.py " + shlex.join(sys.argv[1:])
    out = {
        "command": command,
        "model": model_name,
        "linears": len(shapes),
        "weight_bytes": nbytes,
        "copies": args.copies,
        "threads": args.threads,
        "isa": native_gemv.isa(),
        "rows": res,
    }
    lines = [
        "# Decode linears on the native bf16 GEMV, outside the server",
        "",
        f"Command: `{command}`",
        "",
        f"{model_name}: {len(shapes)} linears of the decoder layers, {nbytes / 2**20:.0f} MiB of bf16 weights, "
        f"{args.copies} random copies cycled through, {args.threads} threads, {native_gemv.isa()}; "
        f"medians of {args.passes} passes.",
        "",
        "| rows | ms per model pass | weight GB/s |",
        "|---:|---:|---:|",
    ]
    lines += [f"| {m} | {r['ms']:.1f} | {r['gb_s']:.1f} |" for m, r in res.items()]
    text = "\n".join(lines) + "\n"
    write_result(OUT, out, text, command=command, allow_dirty=args.allow_dirty)
    print(text)


if __name__ == "__main__":
    main()
