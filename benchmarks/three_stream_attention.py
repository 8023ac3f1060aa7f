"""Decode attention over BF16 + INT4 + INT2 (three streams) vs BF16 + INT4 (two streams), 8k context, batch 8.

    .venv/bin/python benchmarks/three_stream_attention.py [--context 8192] [--batch 8] [--budget 0.25]
        [--h-share 0.1] [--repeats 30] [--threads 1]

Qwen2.5-Coder-0.5B's attention shapes (14 query heads, 2 KV heads, head_dim 64, bf16), random K/V,
``--batch`` rows of ``--context`` tokens in one layer; outside the recent window each token gets a
tier by a low-discrepancy static mix (:class:`pask.policies.static_mix.StaticMixPolicy`). Four
layouts, each timed through the native decode kernel (one call for the batch, the path the model
runs), calls interleaved round-robin, medians:

- ``two_stream``: BF16 share ``h`` plus INT4, the rest released, at budget B (``h + 0.3125 l = B``);
  what a three-action PASK table holds.
- ``three_stream``: the same BF16 share and the same B, with INT2 beside INT4: it releases fewer
  tokens for the same bytes (INT4 share ``l = (B - h) / 2 / 0.3125``, INT2 share
  ``(B - h) / 2 / 0.1875``).
- ``three_stream_same_tokens``: the two-stream layout's retained tokens, half of its INT4 tokens
  in INT2 instead: the same tokens kept, fewer bytes (B below the target).
- ``three_stream_k4v2`` / ``k4v2_same_tokens``: the two three-stream layouts with the INT2 tier
  holding K4V2 (INT4 keys, INT2 values, 0.25 of BF16; ``CacheConfig.l2_key_bits = 4``).
- ``full``: every token BF16 (B = 1), for the bandwidth picture.

Bytes read per call = the live bytes of the layer's tiers (codes, scales and zeros, BF16 K/V), read
from the tensors the cache holds; the effective bandwidth is bytes / time. Writes
``benchmarks/results/three_stream_attention.{json,md}`` with provenance.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import torch

from pask.bench.kv import median_ms
from pask.errors import PaskError
from pask.experiments.provenance import add_allow_dirty, check_clean, write_result
from pask.kv import Action, CostModel
from pask.kv import native_attention as na
from pask.kv.cache import CacheConfig, TieredCache, attention_config
from pask.policies.static_mix import StaticMixPolicy

OUT = Path(__file__).resolve().parent / "results"
HKV, GROUP, D = 2, 7, 64  # Qwen2.5-Coder-0.5B: 14 query heads over 2 KV heads, head_dim 64


def layouts(budget: float, h: float) -> dict[str, tuple[float, float, float, float]]:
    """(H, INT4, INT2, release) shares outside the recent window of each layout (``*k4v2*``: the INT2
    share is K4V2)."""
    c, k = CostModel(), CostModel(l2_key_bits=4)
    if not 0 <= h < budget < c.l_ratio + h * (1 - c.l_ratio):
        raise PaskError(
            f"need 0 <= h-share < budget and budget below INT4's cost with that BF16 share; got {budget}, {h}"
        )
    l_two = (budget - h) / c.l_ratio
    l_three, l2_three = (budget - h) / 2 / c.l_ratio, (budget - h) / 2 / c.l2_ratio
    k4v2_three = (budget - h) / 2 / k.l2_ratio
    return {
        "full": (1.0, 0.0, 0.0, 0.0),
        "two_stream": (h, l_two, 0.0, 1 - h - l_two),
        "three_stream": (h, l_three, l2_three, 1 - h - l_three - l2_three),
        "three_stream_same_tokens": (h, l_two / 2, l_two / 2, 1 - h - l_two),
        "three_stream_k4v2": (h, l_three, k4v2_three, 1 - h - l_three - k4v2_three),
        "k4v2_same_tokens": (h, l_two / 2, l_two / 2, 1 - h - l_two),
    }


def build(batch: int, n: int, shares: tuple[float, float, float, float], kv, l2_key_bits: int = 2) -> TieredCache:
    """One-layer cache, ``batch`` rows of ``n`` tokens, tiers from ``shares`` (same K/V for every layout)."""
    cfg = CacheConfig(num_groups=1, l2_key_bits=l2_key_bits)
    cache = TieredCache(attention_config(HKV, GROUP, D), cfg, batch)
    cache.begin_prefill([0] * batch)
    cache.update(kv[0], kv[1], 0)
    h, int4, int2, r = shares
    mix = StaticMixPolicy(h=h, l=int4, r=r, l2=int2)
    outside = torch.arange(max(0, n - cfg.recent_window))
    acts = mix.assign(outside)
    for row in range(batch):
        for a in (Action.L, Action.L2, Action.R):
            sel = outside[acts == int(a)]
            if sel.numel():
                cache.apply(row, 0, sel, a)
    cache.compact()
    return cache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--h-share", type=float, default=0.1)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    add_allow_dirty(ap)
    args = ap.parse_args()
    stem = OUT / "three_stream_attention"
    check_clean(stem, args.allow_dirty)
    if na.status() != "ok":
        raise SystemExit(f"native attention kernel unavailable: {na.status()}")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    shape = (args.batch, HKV, args.context, D)
    kv = (torch.randn(shape, generator=gen).to(torch.bfloat16), torch.randn(shape, generator=gen).to(torch.bfloat16))
    q = torch.randn(args.batch, HKV * GROUP, 1, D, generator=gen).to(torch.bfloat16)
    scale = D**-0.5
    rows, fns = {}, {}
    for name, shares in layouts(args.budget, args.h_share).items():
        cache = build(args.batch, args.context, shares, kv, 4 if "k4v2" in name else 2)
        layer = cache.layers[0]
        if not na.applies(q, layer):
            raise SystemExit(f"{name}: the native kernel does not serve this layout")
        st = layer.seqs[0]
        read = sum(s.live_bytes() for s in layer.seqs)
        full = cache.full_bytes()  # the BF16 bytes of the same tokens
        rows[name] = {
            "shares_h_int4_int2_r": [round(x, 4) for x in shares],
            "tokens_per_row": {"H": st.h.n, "INT4": st.l.n, "INT2": st.l2.n},
            "kept_tokens": st.h.n + st.l.n + st.l2.n,
            "bytes_read": read,
            "b_measured": read / full,
            "allocated_bytes": cache.allocated_bytes(),
        }
        fns[name] = lambda layer=layer: na.decode_layer(layer, q, scale)
    ms = median_ms(fns, args.repeats)
    for name, row in rows.items():
        row["ms"] = round(ms[name], 4)
        row["gb_per_s"] = round(row["bytes_read"] / (ms[name] * 1e-3) / 1e9, 2)
    two, three, same = rows["two_stream"], rows["three_stream"], rows["three_stream_same_tokens"]
    ratios = {
        "three_vs_two_time": three["ms"] / two["ms"],
        "three_vs_two_bytes": three["bytes_read"] / two["bytes_read"],
        "three_vs_two_kept_tokens": three["kept_tokens"] / two["kept_tokens"],
        "same_tokens_vs_two_time": same["ms"] / two["ms"],
        "same_tokens_vs_two_bytes": same["bytes_read"] / two["bytes_read"],
        "two_vs_full_time": two["ms"] / rows["full"]["ms"],
        "k4v2_vs_two_time": rows["three_stream_k4v2"]["ms"] / two["ms"],
        "k4v2_vs_two_bytes": rows["three_stream_k4v2"]["bytes_read"] / two["bytes_read"],
        "k4v2_vs_two_kept_tokens": rows["three_stream_k4v2"]["kept_tokens"] / two["kept_tokens"],
        "k4v2_same_tokens_vs_two_time": rows["k4v2_same_tokens"]["ms"] / two["ms"],
        "k4v2_same_tokens_vs_two_bytes": rows["k4v2_same_tokens"]["bytes_read"] / two["bytes_read"],
    }
    command = "python benchmarks/three_stream_attention.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    data = {"args": {k: v for k, v in vars(args).items() if k != "allow_dirty"}, "isa": na.isa(), "layouts": rows}
    data["ratios"] = {k: round(v, 4) for k, v in ratios.items()}
    lines = [
        "# Three-stream decode attention (BF16 + INT4 + INT2) vs two-stream, "
        f"{args.context} tokens x batch {args.batch}",
        "",
        f"Command: `{command}`  ",
        f"One layer of Qwen2.5-Coder-0.5B's shapes (14 q heads, 2 KV heads, head_dim 64, bf16), native kernel "
        f"({na.isa()}), {args.threads} thread(s), median of {args.repeats} interleaved calls. Target B {args.budget}, "
        f"BF16 share {args.h_share} outside the recent window. Bytes read = live bytes of the tiers "
        "(codes + scales + zeros + BF16 K/V), from the cache's tensors.",
        "",
        "| layout | H / INT4 / INT2 / released | kept tokens per row | bytes read | B | ms | GB/s |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        s = " / ".join(f"{x:.3f}" for x in r["shares_h_int4_int2_r"])
        lines.append(
            f"| {name} | {s} | {r['kept_tokens']} | {r['bytes_read']:,} | {r['b_measured']:.4f} | {r['ms']:.3f} | "
            f"{r['gb_per_s']:.1f} |"
        )
    lines += [
        "",
        f"- Same B: three streams keep {ratios['three_vs_two_kept_tokens']:.3f}x the tokens of two streams for "
        f"{ratios['three_vs_two_bytes']:.3f}x the bytes, in {ratios['three_vs_two_time']:.3f}x the time.",
        f"- Same kept tokens: half the INT4 tokens in INT2 read {ratios['same_tokens_vs_two_bytes']:.3f}x the bytes "
        f"in {ratios['same_tokens_vs_two_time']:.3f}x the time.",
        f"- Two streams at B {two['b_measured']:.3f} take {ratios['two_vs_full_time']:.3f}x the time of all-BF16.",
        f"- K4V2 as the third stream, same B: {ratios['k4v2_vs_two_kept_tokens']:.3f}x the tokens for "
        f"{ratios['k4v2_vs_two_bytes']:.3f}x the bytes in {ratios['k4v2_vs_two_time']:.3f}x the time; same kept "
        f"tokens: {ratios['k4v2_same_tokens_vs_two_bytes']:.3f}x the bytes in "
        f"{ratios['k4v2_same_tokens_vs_two_time']:.3f}x the time.",
    ]
    json_path, _ = write_result(stem, data, "\n".join(lines) + "\n", command=command, allow_dirty=args.allow_dirty)
    print("\n".join(lines))
    print(f"wrote {json_path}")


if __name__ == "__main__":
    main()
