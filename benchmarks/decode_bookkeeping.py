"""The cache's own work in one batched decode step, outside attention: H-tier appends and policy moves.

    .venv/bin/python benchmarks/decode_bookkeeping.py [--batch 16] [--prompt 1024] [--steps 40] [--threads 2]

Qwen2.5-Coder-0.5B's KV layout (24 layers in 4 groups, 2 KV heads, head_dim 64, bf16), random K/V,
``--batch`` rows of ``--prompt`` tokens. One step = the new token of every row stored in all 24
layers (what the model's forward does through ``TieredCache.update``), then per row the decision
on the token leaving the recent window (:func:`pask.runtime.session.decide_row`), every row's actions
applied at once (:meth:`TieredCache.apply_many`), and each row's measured budget
(:func:`pask.runtime.session.row_budget`), as the server's scheduler does after each forward.
Two workloads: ``appends`` (the leaving token stays H: no moves) and ``moves`` (it goes INT4 in two
layer groups and is released in a third: three cache actions per row and step). Each runs with the
native kernels (``CacheConfig.native``: one call per layer for the appends, one per group for an
INT4 move) and without them (PyTorch row by row), interleaved; medians of ``--repeats`` runs of
``--steps`` steps. Writes ``benchmarks/results/decode_bookkeeping.{json,md}`` with the command.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from pask.experiments.provenance import add_allow_dirty, check_clean, write_result
from pask.kv import Action, CostModel
from pask.kv import native_attention as na
from pask.kv.cache import CacheConfig, TieredCache
from pask.runtime.session import decide_row, row_budget

OUT = Path(__file__).resolve().parent / "results"
QWEN_05B = SimpleNamespace(
    num_hidden_layers=24, num_key_value_heads=2, head_dim=64, hidden_size=896, num_attention_heads=14
)
COSTS = CostModel()  # INT4 0.3125, INT2 0.1875 of BF16 at head_dim 64


def keep(ctx) -> list:
    """The leaving token stays H (no action)."""
    return []


def move(ctx) -> list:
    """The leaving token goes INT4 in groups 0 and 1 and is released in group 2."""
    if not ctx.leaving.numel():
        return []
    return [(0, ctx.leaving, Action.L), (1, ctx.leaving, Action.L), (2, ctx.leaving, Action.R)]


def run(batch: int, prompt: int, steps: int, decide, native: bool) -> float:
    """Milliseconds per decode step of the cache's bookkeeping."""
    cfg = CacheConfig(num_groups=4, headroom=steps + 8, native=native)
    cache = TieredCache(QWEN_05B, cfg, batch)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(batch, 2, prompt, 64, generator=gen).to(torch.bfloat16)
    cache.begin_prefill([0] * batch)
    for layer in range(QWEN_05B.num_hidden_layers):
        cache.update(k, k, layer)
    decided = [0] * batch
    for b in range(batch):  # the prompt: all but the recent window INT4 in group 0 (sets the key balance)
        decided[b] = decide_row(cache, b, lambda c: [(0, c.leaving, Action.L)], 0, [], [], None, COSTS)
    new = torch.randn(batch, 2, 1, 64, generator=gen).to(torch.bfloat16)

    def step() -> None:  # as the scheduler's decode step: every row's actions, then one apply_many
        for layer in range(QWEN_05B.num_hidden_layers):
            cache.update(new, new, layer)
        ops: list = []
        for b in range(batch):
            decided[b] = decide_row(cache, b, decide, decided[b], [], [], None, COSTS, ops=ops)
        if ops:
            cache.apply_many(ops)
        for b in range(batch):
            row_budget(cache, b)

    step()  # warm-up (first native call, index growth)
    t = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t) * 1e3 / steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=OUT / "decode_bookkeeping")
    add_allow_dirty(ap)
    args = ap.parse_args(argv)
    check_clean(args.out, args.allow_dirty)
    if min(args.batch, args.prompt, args.steps, args.repeats, args.threads) < 1:
        ap.error("--batch, --prompt, --steps, --repeats and --threads must be >= 1")
    if args.prompt <= CacheConfig().recent_window:
        ap.error(f"--prompt must exceed the recent window ({CacheConfig().recent_window} tokens)")
    if not na.available():
        print(f"native attention kernel: {na.status()}; nothing to compare", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    rows = []
    for name, decide in (("appends", keep), ("moves", move)):
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.repeats):
            for native in (True, False):
                times[native].append(run(args.batch, args.prompt, args.steps, decide, native))
        nat, py = statistics.median(times[True]), statistics.median(times[False])
        rows.append({"workload": name, "native_ms": round(nat, 3), "pytorch_ms": round(py, 3), "speedup": py / nat})
        print(f"{name}: native {nat:.2f} ms, PyTorch {py:.2f} ms per step", flush=True)
    command = "python benchmarks/decode_bookkeeping.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    result = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "rows": rows}
    result["command"] = command.strip()
    md = [
        "# Cache bookkeeping per batched decode step (outside attention)",
        "",
        f"Command: `{result['command']}`",
        "",
        f"qwen2.5-coder-0.5b's KV layout (24 layers, 4 groups, 2 kv heads of 64, bf16), batch {args.batch}, "
        f"{args.prompt}-token prompts, {args.threads} thread(s); medians of {args.repeats} runs of {args.steps} steps. "
        "Per step: every row's new token appended in all layers, then per row the leaving token's decision "
        "(`decide_row`) and budget (`row_budget`). `moves`: INT4 in two layer groups, released in a third.",
        "",
        "| workload | native kernels ms | PyTorch row by row ms | speed-up |",
        "|---|---:|---:|---:|",
        *[f"| {r['workload']} | {r['native_ms']:.2f} | {r['pytorch_ms']:.2f} | {r['speedup']:.2f}x |" for r in rows],
    ]
    text = "\n".join(md) + "\n"
    write_result(args.out, result, text, command=result["command"], allow_dirty=args.allow_dirty)
    return 0


if __name__ == "__main__":
    sys.exit(main())
