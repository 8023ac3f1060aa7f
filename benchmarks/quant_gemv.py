"""The decode linears of a model over INT8 / INT4 weights: the int8-activation kernel against the dequantising one.

    .venv/bin/python benchmarks/quant_gemv.py [--model qwen2.5-coder-0.5b] [--bits 8,4] [--rows 1,8,16]
        [--copies 2] [--passes 8] [--threads 2] [--out NAME]

Takes the shapes of every ``nn.Linear`` of the model's decoder layers (not the LM head), quantises
``--copies`` sets of random weights of those shapes to the tiled layout (:func:`pask.cpu.weights.quantize`;
several sets, so that a pass does not find them in the last-level cache) and times passes over one
set after another with :func:`pask.cpu.native_gemv.linear_quant` at each batch size (rows), as a
decode step calls them: on the AVX2 build with the int8-activation kernel (``avx2-int8``) and with
the dequantising bf16 kernels (``PASK_INT8_LINEAR=0``), pass by pass in turn, so that both see the
same host. Reports milliseconds per model pass (medians), the ratio, and the weight bytes read per
second. Needs the AVX2 build's switch (:func:`pask.cpu.native_gemv.use_int8_linears`); elsewhere it
exits 2. Writes ``benchmarks/results/<out>.{json,md}``.
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
from pask.cpu import weights as W
from pask.errors import PaskError
from pask.experiments.provenance import add_allow_dirty, check_clean, write_result
from pask.runtime.models import load_model

RESULTS = Path(__file__).resolve().parent / "results"
KERNELS = ("avx2-int8", "dequant")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--bits", default="8,4", help="comma-separated code widths (4, 8)")
    ap.add_argument("--rows", default="1,8,16", help="comma-separated batch sizes (at most 16)")
    ap.add_argument("--copies", type=int, default=2, help="weight sets cycled through (beat the cache)")
    ap.add_argument("--passes", type=int, default=8, help="timed passes per kernel, width and batch size")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="quant_gemv", help="result stem under benchmarks/results/")
    add_allow_dirty(ap)
    args = ap.parse_args()
    out_stem = RESULTS / args.out
    try:
        rows = [int(r) for r in args.rows.split(",")]
        bits = [int(b) for b in args.bits.split(",")]
    except ValueError:
        ap.error("--rows and --bits take comma-separated integers")
    if any(not 1 <= r <= native_gemv.MAX_ROWS for r in rows):
        ap.error(f"--rows must lie in 1..{native_gemv.MAX_ROWS}")
    if any(b not in W.BITS.values() for b in bits):
        ap.error("--bits takes 4 and / or 8")
    if args.copies < 1 or args.passes < 1 or args.threads < 1:
        ap.error("--copies, --passes and --threads must be >= 1")
    try:
        check_clean(out_stem, args.allow_dirty)  # before the run, not after it
    except PaskError as e:
        ap.error(str(e))
    torch.set_num_threads(args.threads)
    was = native_gemv.use_int8_linears(None)
    if not native_gemv.use_int8_linears(True):
        ap.error(f"no AVX2 int8-activation kernel in this build ({native_gemv.status()}, {native_gemv.isa()})")
    lm = load_model(args.model)
    shapes = [
        (m.out_features, m.in_features, m.bias is not None)
        for m in lm.model.model.layers.modules()
        if isinstance(m, torch.nn.Linear)
    ]
    model_name = lm.name
    del lm
    gen = torch.Generator().manual_seed(0)
    res: dict[str, dict] = {}
    try:
        for nbits in bits:
            sets = []
            for _ in range(args.copies):
                layer = []
                for n, k, b in shapes:
                    codes, sz = W.quantize(torch.randn(n, k, generator=gen) * 0.05, nbits)
                    layer.append((codes, sz, n, torch.randn(n, generator=gen).bfloat16() if b else None))
                sets.append(layer)
            nbytes = sum(c.numel() + s.numel() * 2 for c, s, _, _ in sets[0])
            for m in rows:
                xs = {k: torch.randn(m, k, generator=gen).bfloat16() for _, k, _ in shapes}
                times: dict[str, list[float]] = {k: [] for k in KERNELS}
                for p in range(args.passes + args.copies):  # the first round over the copies is warm-up
                    for kernel in KERNELS:
                        native_gemv.use_int8_linears(kernel == "avx2-int8")
                        t = time.perf_counter()
                        for (codes, sz, n, b), (_, k, _) in zip(sets[p % args.copies], shapes, strict=True):
                            native_gemv.linear_quant(xs[k], codes, sz, n, nbits, b)
                        if p >= args.copies:
                            times[kernel].append(time.perf_counter() - t)
                ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
                res[f"int{nbits} x {m}"] = {
                    "bits": nbits,
                    "rows": m,
                    "ms": ms,
                    "speedup": ms["dequant"] / ms["avx2-int8"],
                    "gb_s": {k: nbytes / v / 1e6 for k, v in ms.items()},
                    "weight_bytes": nbytes,
                }
    finally:
        native_gemv.use_int8_linears(was)
    command = "python benchmarks/quant_gemv.py " + shlex.join(sys.argv[1:])
    out = {
        "command": command,
        "model": model_name,
        "linears": len(shapes),
        "copies": args.copies,
        "threads": args.threads,
        "isa": native_gemv.isa(),
        "cases": res,
    }
    lines = [
        "# Decode linears over INT8 / INT4 weights: the int8-activation kernel against the dequantising one",
        "",
        f"Command: `{command}`",
        "",
        f"{model_name}: the {len(shapes)} linears of the decoder layers (LM head not included), random weights "
        f"quantised per group of 32, {args.copies} copies cycled through, {args.threads} threads, "
        f"{native_gemv.isa()}; medians of {args.passes} passes per kernel, the kernels pass by pass in turn.",
        "",
        "| weights x rows | avx2-int8 ms | dequant ms | speed-up | avx2-int8 GB/s | dequant GB/s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in res.items():
        lines.append(
            f"| {name} | {r['ms']['avx2-int8']:.1f} | {r['ms']['dequant']:.1f} | {r['speedup']:.2f}x | "
            f"{r['gb_s']['avx2-int8']:.1f} | {r['gb_s']['dequant']:.1f} |"
        )
    text = "\n".join(lines) + "\n"
    write_result(out_stem, out, text, command=command, allow_dirty=args.allow_dirty)
    print(text)


if __name__ == "__main__":
    main()
