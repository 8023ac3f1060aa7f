"""A decode step in the main thread vs in another thread, with and without an OpenMP pool left in the main thread.

    .venv/bin/python benchmarks/decode_thread.py [--model qwen2.5-coder-0.5b] [--batch 8] [--context 8192] [--threads 2]

The server decodes in its own thread (``pask/serving/worker.py``). OpenMP keeps a pool of worker
threads per thread that starts parallel regions; when the pools hold more threads than the CPU
has cores, libgomp stops spin-waiting between regions. This benchmark fills a tiered cache with
random K/V (every token BF16, the Full KV case) and times decode steps (medians, interleaved):

* ``main``: in the main thread;
* ``thread``: in a second thread, the main thread holding no pool (``load_model`` loads in a
  thread of its own, :func:`pask.runtime.models.in_own_thread`; the pool the native kernels' start-up
  probes leave in the main thread is released first);
* ``thread, pool in main``: the same after the main thread ran one parallel region (what loading
  the model in the main thread, or probing the native kernels there, leaves behind);
* ``thread, pool in main released``: the same after :func:`pask.cpu.openmp.release_pool` in the main
  thread (what the server does before its decode thread starts).

The decode linears are computed as the server computes them (:func:`pask.cpu.bf16_matmul.serving_mode`).

Writes ``benchmarks/results/decode_thread.{json,md}``.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from pask.cpu import bf16_matmul, openmp
from pask.experiments.provenance import add_allow_dirty, check_clean, write_result
from pask.kv.attention import enable_pask_attention
from pask.kv.cache import CacheConfig, TieredCache
from pask.runtime.models import in_own_thread, load_model

OUT = Path(__file__).resolve().parent / "results" / "decode_thread"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=10, help="steps per setting and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    add_allow_dirty(ap)
    args = ap.parse_args()
    check_clean(OUT, args.allow_dirty)
    torch.set_num_threads(args.threads)
    lm = load_model(args.model)
    m, cfg = lm.model, lm.model.config
    enable_pask_attention(m)
    linears = bf16_matmul.apply_gemv(m, bf16_matmul.serving_mode())
    b, n = args.batch, args.context
    d = cfg.hidden_size // cfg.num_attention_heads

    def build() -> TieredCache:
        cache = TieredCache(cfg, CacheConfig(headroom=args.steps * args.rounds * 3 + 8), b)
        gen = torch.Generator().manual_seed(0)
        for layer in range(cfg.num_hidden_layers):
            k = torch.randn(b, cfg.num_key_value_heads, n, d, generator=gen).to(torch.bfloat16)
            cache.update(k, k, layer)
        return cache

    cache = in_own_thread(build)
    keys = ("main", "thread", "thread, pool in main", "thread, pool in main released")
    times: dict[str, list[float]] = {k: [] for k in keys}
    pos = [n]

    def steps(key: str) -> None:
        with torch.inference_mode():
            for _ in range(args.steps):
                ids = torch.randint(0, 1000, (b, 1))
                t = time.perf_counter()
                m(input_ids=ids, position_ids=torch.full((b, 1), pos[0]), cache=cache, use_cache=True)
                times[key].append(time.perf_counter() - t)
                pos[0] += 1

    openmp.release_pool()  # the native kernels' probes ran here
    for _ in range(args.rounds):  # no pool in the main thread: thread first, then main (creates it)
        in_own_thread(lambda: steps("thread"))
    for _ in range(args.rounds):
        steps("main")
        in_own_thread(lambda: steps("thread, pool in main"))
        openmp.release_pool()
        in_own_thread(lambda: steps("thread, pool in main released"))
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    command = "python benchmarks/decode_thread.py " + shlex.join(sys.argv[1:])
    result = {
        "command": command,
        "model": lm.name,
        "batch": b,
        "context": n,
        "threads": args.threads,
        "gemv_linears": linears,
        "step_ms": ms,
    }
    lines = [
        "# Decode step: main thread vs another thread (OpenMP pools)",
        "",
        f"Command: `{command}`",
        "",
        f"{lm.name}, bf16, batch {b}, {n} cached tokens (random K/V, every token BF16), {args.threads} threads, "
        f"medians of {args.steps * args.rounds} steps per row; "
        f"{linears} linears on the native bf16 GEMV (0: PyTorch's GEMM).",
        "",
        "| where the step runs | step ms | x main |",
        "|---|---:|---:|",
    ]
    for k, v in ms.items():
        lines.append(f"| {k} | {v:.1f} | {ms['main'] / v:.2f}x |")
    text = "\n".join(lines) + "\n"
    write_result(OUT, result, text, command=command, allow_dirty=args.allow_dirty)
    print(text)


if __name__ == "__main__":
    main()
