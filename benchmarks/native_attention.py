"""Decode attention of one layer for a batch: native kernel vs PyTorch's fused path vs full SDPA.

Synthetic BF16 K/V in qwen2.5-coder-0.5b's attention shape (2 kv / 14 query heads, head_dim 64),
``--batch`` sequences of ``--context`` tokens each, tiers drawn per token from an (H, L, R) mix
outside the recent window. Per setting, medians of interleaved runs of

* ``native``: :func:`pask.kv.native_attention.decode_layer` (one call for the batch);
* ``native_no_amx`` (CPUs with AMX tiles only): the same call with the INT4 tier on AVX-512 FMAs
  (:func:`pask.kv.native_attention.use_amx`);
* ``torch_fused``: PyTorch's fused path per sequence (flash for H, int4 GEMMs for INT4);
* ``sdpa_full``: ``scaled_dot_product_attention`` over all tokens in BF16 (what Full KV runs
  with transformers' SDPA).

Also the INT4 move of one token per layer group per sequence (the decode-step action), native
vs the PyTorch path. With ``--step-layers L`` (and ``--step-contexts``), also a decode step's
worth of layers: L layers of their own K/V, each attended once per pass as a step does, so that
the KV comes from memory as in serving rather than from the last-level cache one repeated layer
fits in (the all-BF16 layer at 8k, batch 8 is 33.5 MB). Writes
``benchmarks/results/native_attention.{json,md}``::

    python benchmarks/native_attention.py --threads 2 --step-layers 24
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

from pask.bench.kv import median_ms
from pask.experiments.provenance import add_allow_dirty, check_clean, write_result
from pask.kv import Action, CacheConfig, TieredCache, fastpath
from pask.kv import native_attention as na
from pask.kv.cache import attention_config

OUT = Path(__file__).parent / "results" / "native_attention"
HKV, GRP, D = 2, 7, 64
MIXES = {"all H": (1.0, 0.0, 0.0), "H/L/R thirds": (0.34, 0.33, 0.33), "mostly INT4": (0.05, 0.9, 0.05)}
INT8_NAME, EXACT_NAME = "mostly INT4, integer path", "mostly INT4, exact path"  # the AVX2 build's other INT4 path


def tiered_cache(batch: int, n: int, mix: tuple[float, float, float], gen, layers: int = 1):
    """A cache of ``layers`` layers of random bf16 K/V, tiers drawn per token from ``mix`` (H, L, R)
    outside the recent window (the same for every layer: one layer group); also the last layer's K, V."""
    cache = TieredCache(attention_config(HKV, GRP, D, layers=layers), CacheConfig(num_groups=1), batch)
    for layer in range(layers):
        k = torch.randn(batch, HKV, n, D, generator=gen).to(torch.bfloat16)
        v = torch.randn(batch, HKV, n, D, generator=gen).to(torch.bfloat16)
        cache.update(k, v, layer)
    window = cache.config.recent_window
    for b in range(batch):
        u = torch.rand(n - window, generator=gen)
        tier = torch.where(u < mix[0], 0, torch.where(u < mix[0] + mix[1], 1, 2))
        for a in (Action.L, Action.R):
            cache.apply(b, 0, torch.nonzero(tier == int(a)).flatten(), a)
    return cache, k, v


def attention_case(batch: int, n: int, mix: tuple[float, float, float], repeats: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    cache, k, v = tiered_cache(batch, n, mix, gen)
    layer = cache.layers[0]
    q = torch.randn(batch, HKV * GRP, 1, D, generator=gen).to(torch.bfloat16)
    fns = {
        "native": lambda: na.decode_layer(layer, q, D**-0.5),
        "sdpa_full": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True),
    }
    if na.use_amx(True):  # the same kernel with the INT4 tier on AVX-512 FMAs instead of AMX tiles

        def vector():
            na.use_amx(False)
            try:
                return na.decode_layer(layer, q, D**-0.5)
            finally:
                na.use_amx(True)

        fns["native_no_amx"] = vector
    if fastpath.available():
        fns["torch_fused"] = lambda: [fastpath.decode_attention(q[b], layer.seqs[b], D**-0.5) for b in range(batch)]
    ms = median_ms(fns, repeats)
    held, full = cache.budget_bytes()
    return {
        "batch": batch,
        "context": n,
        "mix": list(mix),
        "b_measured": round(sum(held) / sum(full), 4),
        "ms": {k: round(x, 4) for k, x in ms.items()},
        "native_vs_sdpa": round(ms["sdpa_full"] / ms["native"], 3),
        "native_vs_torch_fused": round(ms["torch_fused"] / ms["native"], 3) if "torch_fused" in ms else None,
        "amx_vs_no_amx": round(ms["native_no_amx"] / ms["native"], 3) if "native_no_amx" in ms else None,
    }


def step_case(batch: int, n: int, layers: int, repeats: int) -> dict:
    """All-H and mostly-INT4 caches of ``layers`` layers each; one pass over every layer, timed."""
    caches = {
        name: tiered_cache(batch, n, MIXES[name], torch.Generator().manual_seed(0), layers)[0]
        for name in ("all H", "mostly INT4")
    }
    q = torch.randn(batch, HKV * GRP, 1, D, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    fns = {
        name: (lambda c=c: [na.decode_layer(c.layers[i], q, D**-0.5) for i in range(layers)])
        for name, c in caches.items()
    }
    before = na.use_int8()
    with na.int8_path(not before) as now:
        switchable = now != before  # the AVX2 build: time the INT4 tier both ways, interleaved
    if switchable:

        def other(c=caches["mostly INT4"], flag=not before):
            with na.int8_path(flag):
                return [na.decode_layer(c.layers[i], q, D**-0.5) for i in range(layers)]

        fns[INT8_NAME if not before else EXACT_NAME] = other
    ms = median_ms(fns, repeats)
    out = {"batch": batch, "context": n, "layers": layers, "per_layer_ms": {}, "held_mb": {}, "gb_s": {}}
    out["int8_default"] = before
    for extra in (INT8_NAME, EXACT_NAME):
        if extra in ms:
            out["per_layer_ms"][extra] = round(ms[extra] / layers, 4)
    for name, c in caches.items():
        held, full = c.budget_bytes()
        per_layer = ms[name] / layers
        out["per_layer_ms"][name] = round(per_layer, 4)
        out["held_mb"][name] = round(sum(held) / layers / 1e6, 2)
        out["gb_s"][name] = round(sum(held) / layers / 1e6 / per_layer, 2)
        out.setdefault("b_measured", {})[name] = round(sum(held) / sum(full), 4)
    out["int4_vs_bf16"] = round(out["per_layer_ms"]["mostly INT4"] / out["per_layer_ms"]["all H"], 3)
    for extra in (INT8_NAME, EXACT_NAME):
        if extra in out["per_layer_ms"]:
            out["int4_vs_bf16_" + ("int8" if extra == INT8_NAME else "exact")] = round(
                out["per_layer_ms"][extra] / out["per_layer_ms"]["all H"], 3
            )
    return out


def move_case(batch: int, n: int, steps: int) -> dict:
    """One token leaving the window per sequence and layer group (4 groups, 24 layers) per step."""
    out = {}
    for native in (False, True):
        cache = TieredCache(attention_config(HKV, GRP, D, layers=24), CacheConfig(native=native), batch)
        k = torch.randn(batch, HKV, n, D).to(torch.bfloat16)
        for layer in range(24):
            cache.update(k, k, layer)
        for b in range(batch):
            for g in range(4):
                cache.apply(b, g, torch.arange(0, n // 2), Action.L)
        t = time.perf_counter()
        for p in range(n // 2, n // 2 + steps):
            for b in range(batch):
                for g in range(4):
                    cache.apply(b, g, p, Action.L)
        out["native" if native else "torch"] = round((time.perf_counter() - t) / steps * 1e3, 3)
    out["speedup"] = round(out["torch"] / out["native"], 2)
    return {"batch": batch, "context": n, "steps": steps, "ms_per_step": out}


def markdown(r: dict) -> str:
    lines = [
        "# Native decode attention: one layer, a batch of sequences, one query token each",
        "",
        f"Command: `{r['command']}`",
        "",
        f"Synthetic BF16 K/V, {HKV} kv / {HKV * GRP} query heads, head_dim {D} (qwen2.5-coder-0.5b); "
        f"torch {r['torch']}, {r['threads']} thread(s), medians of {r['repeats']} interleaved runs. "
        f"Kernel: {r['native_status']} ({r.get('native_isa')} build; CPU {r.get('cpu')}, PyTorch capability "
        f"{r.get('torch_cpu_capability')}). PyTorch fused: `-` where its int4 GEMM is not available.",
        "",
        "| batch | context | mix (H/L/R) | B | SDPA full ms | PyTorch fused ms | native ms | native vs SDPA | "
        "native vs PyTorch fused | native without AMX ms | AMX speed-up |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in r["attention"]:
        m = c["ms"]
        fused = f"{m['torch_fused']:.3f}" if "torch_fused" in m else "-"
        vs_fused = f"{c['native_vs_torch_fused']:.2f}x" if c["native_vs_torch_fused"] else "-"
        no_amx = f"{m['native_no_amx']:.3f}" if "native_no_amx" in m else "-"
        amx = f"{c['amx_vs_no_amx']:.2f}x" if c.get("amx_vs_no_amx") else "-"
        lines.append(
            f"| {c['batch']} | {c['context']} | {'/'.join(f'{x:g}' for x in c['mix'])} | {c['b_measured']:.3f} | "
            f"{m['sdpa_full']:.3f} | {fused} | {m['native']:.3f} | {c['native_vs_sdpa']:.2f}x | {vs_fused} | "
            f"{no_amx} | {amx} |"
        )
    if r.get("step"):
        lines += [
            "",
            "A decode step's layers: each layer its own K/V, every layer attended once per pass (per-layer time = "
            "the pass / layers), so the KV comes from memory as in serving:",
            "",
            "| batch | context | layers | all-BF16 ms / layer | mostly-INT4 ms / layer | INT4 vs BF16 | MB held per "
            "layer (BF16 / INT4) | GB/s (BF16 / INT4) | B (INT4) |",
            "|---:|---:|---:|---:|---:|---:|---|---|---:|",
        ]
        for c in r["step"]:
            t, h, g = c["per_layer_ms"], c["held_mb"], c["gb_s"]
            lines.append(
                f"| {c['batch']} | {c['context']} | {c['layers']} | {t['all H']:.3f} | {t['mostly INT4']:.3f} | "
                f"{c['int4_vs_bf16']:.2f}x | {h['all H']:.1f} / {h['mostly INT4']:.1f} | "
                f"{g['all H']:.1f} / {g['mostly INT4']:.1f} | {c['b_measured']['mostly INT4']:.3f} |"
            )
        for c in r["step"]:
            for extra, key in ((INT8_NAME, "int8"), (EXACT_NAME, "exact")):
                if extra in c["per_layer_ms"]:
                    lines.append(
                        f"\nThe same step, interleaved, with the INT4 tier on the AVX2 build's "
                        f"{'integer' if key == 'int8' else 'exact'} path (`PASK_INT8_ATTENTION`; the row above: "
                        f"{'on' if c.get('int8_default') else 'off'}): {c['per_layer_ms'][extra]:.3f} ms / layer, "
                        f"{c['int4_vs_bf16_' + key]:.2f}x the all-BF16 layer (context {c['context']})."
                    )
    mv = r["move"]
    lines += [
        "",
        f"INT4 move of the token leaving the window, {mv['batch']} sequences x 4 layer groups (24 layers), per "
        f"decode step: PyTorch path {mv['ms_per_step']['torch']:.2f} ms, native {mv['ms_per_step']['native']:.2f} ms "
        f"({mv['ms_per_step']['speedup']:.1f}x; bit-exact, tests/test_native_attention.py).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--step-layers", type=int, default=0, help="also time a step's worth of layers (0: not)")
    ap.add_argument("--step-contexts", type=int, nargs="+", default=[2048, 8192])
    add_allow_dirty(ap)
    args = ap.parse_args(argv)
    if args.step_layers < 0 or args.batch < 1 or args.repeats < 1 or args.threads < 1:
        ap.error("--step-layers >= 0, --batch, --repeats and --threads >= 1")
    check_clean(args.out, args.allow_dirty)
    if not na.available():
        print(f"native kernel {na.status()}", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    result = {
        "command": "python benchmarks/native_attention.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "torch": torch.__version__,
        "threads": args.threads,
        "repeats": args.repeats,
        "native_status": na.status(),
        "native_isa": na.isa(),
        "cpu": platform.processor() or platform.machine(),
        "torch_cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
        "attention": [],
    }
    with torch.no_grad():
        for n in args.contexts:
            for mix in MIXES.values():
                result["attention"].append(attention_case(args.batch, n, mix, args.repeats))
                print(json.dumps(result["attention"][-1]), flush=True)
        if args.step_layers:
            result["step"] = []
            for n in args.step_contexts:
                result["step"].append(step_case(args.batch, n, args.step_layers, max(3, args.repeats // 4)))
                print(json.dumps(result["step"][-1]), flush=True)
        result["move"] = move_case(args.batch, 2048, 100)
    md = markdown(result)
    write_result(args.out, result, md, command=result["command"], allow_dirty=args.allow_dirty, indent=1)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
