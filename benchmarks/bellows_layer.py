"""The parts of one BellowsKV layer's decode attention, timed alone on random data of the right shapes.

    .venv/bin/python benchmarks/bellows_layer.py [--tokens 8192] [--batch 8] [--key-dims 896 768 256 64]
        [--value-dims 512] [--threads 1] [--repeats 5] [--out benchmarks/results/bellows/layer-8k-b8]

For ``--batch`` sequences of ``--tokens`` latent tokens each (qwen2.5-coder-0.5b's shapes: 2 kv
heads of 64, 7 query rows per kv head), per layer and decode step:

* the key GEMM (latents ``[tokens x batch, key dims]`` x the layer's key projection ``[key dims,
  128]``, bf16), for each ``--key-dims``;
* the scores from its output: bias, RoPE and the query product, in PyTorch (what
  ``LatentTier.rope_keys`` then ``latent_attention`` do) and in the native kernel
  (:mod:`pask.kv.native_latent`);
* the folded values: softmax weights times the value part of the latents (``--value-dims``), per
  sequence, as ``OnlineSoftmax.update_projected`` does (bf16 product).

Medians of ``--repeats`` after one warm-up. Beside ``benchmarks/bellows_step.py`` (the whole model),
this says where a step's time goes.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from pask.experiments.provenance import add_allow_dirty, check_clean, write_result
from pask.kv import native_latent

HKV, D, ROWS = 2, 64, 7


def _time(fn, repeats: int) -> float:
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--key-dims", type=int, nargs="+", default=[896, 768, 256, 64])
    ap.add_argument("--value-dims", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/bellows/layer-8k-b8"))
    add_allow_dirty(ap)
    args = ap.parse_args(argv)
    if min(args.tokens, args.batch, args.value_dims, args.threads, args.repeats, *args.key_dims) < 1:
        ap.error("every size, --threads and --repeats must be >= 1")
    check_clean(args.out, args.allow_dirty)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    m = args.tokens * args.batch
    starts = [b * args.tokens for b in range(args.batch + 1)]
    q = torch.randn(args.batch, HKV, ROWS, D, generator=gen)
    ang = torch.rand(m, D // 2, generator=gen) * 100
    cos, sin = torch.cat([ang.cos()] * 2, dim=1), torch.cat([ang.sin()] * 2, dim=1)
    bias = torch.randn(HKV * D, generator=gen).bfloat16()
    rows = []
    pre = None
    for kd in args.key_dims:
        z = torch.randn(m, kd, generator=gen).bfloat16()
        w = (torch.randn(kd, HKV * D, generator=gen) * kd**-0.5).bfloat16()
        ms = _time(lambda z=z, w=w: torch.matmul(z, w), args.repeats)
        pre = torch.matmul(z, w)
        rows.append({"part": f"key GEMM, {kd} key dims", "ms": round(ms, 2),
                     "gmac_per_s": round(m * kd * HKV * D / ms / 1e6, 1)})  # fmt: skip

    def torch_scores() -> None:
        k = (pre + bias).float().view(-1, HKV, D).transpose(0, 1)
        rot = torch.cat([-k[..., D // 2 :], k[..., : D // 2]], dim=-1)
        k = k * cos + rot * sin
        for b in range(args.batch):
            torch.matmul(q[b], k[:, starts[b] : starts[b + 1]].transpose(1, 2))

    ms = _time(torch_scores, args.repeats)
    rows.append({"part": "scores: bias + RoPE + query product, PyTorch", "ms": round(ms, 2)})
    if native_latent.applies(pre, q):
        ms = _time(lambda: native_latent.scores(pre, bias, cos, sin, starts, q, 0.125), args.repeats)
        rows.append({"part": "scores: bias + RoPE + query product, native", "ms": round(ms, 2)})
    zv = torch.randn(m, args.value_dims, generator=gen).bfloat16()
    p = torch.rand(HKV, ROWS, args.tokens, generator=gen)

    def fold() -> None:
        for b in range(args.batch):
            torch.matmul(p.to(zv.dtype), zv[starts[b] : starts[b + 1]])

    rows.append({"part": f"folded values, {args.value_dims} value dims", "ms": round(_time(fold, args.repeats), 2)})
    data = {"tokens": args.tokens, "batch": args.batch, "threads": args.threads, "repeats": args.repeats,
            "kv_heads": HKV, "head_dim": D, "query_rows_per_kv_head": ROWS, "rows": rows,
            "native_latent": native_latent.status()}  # fmt: skip
    lines = [
        f"# BellowsKV: one layer's decode attention by parts, {args.tokens} tokens x batch {args.batch}, "
        f"{args.threads} threads",
        "",
        f"Median of {args.repeats} (after a warm-up), random data in qwen2.5-coder-0.5b's shapes (2 kv heads of 64, "
        "7 query rows per kv head); one layer of one decode step.",
        "",
        "| part | ms per layer | G MAC / s |",
        "|---|---:|---:|",
        *(f"| {r['part']} | {r['ms']} | {r.get('gmac_per_s', '')} |" for r in rows),
    ]
    command = "python benchmarks/bellows_layer.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    js, md = write_result(args.out, data, "\n".join(lines) + "\n", command=command, allow_dirty=args.allow_dirty)
    print(md.read_text() if md else js)
    return 0


if __name__ == "__main__":
    sys.exit(main())
