"""Memory that PyTorch's bf16 GEMM keeps per input shape, with and without bucketed row counts.

    .venv/bin/python benchmarks/gemm_shapes.py [--lengths 120] [--steps 600] \
        [--projections P.safetensors] [--threads 1] [--out benchmarks/results/gemm_shapes]

Each measurement runs in a process of its own (resident memory is per process) and reports how
much the resident set grew after a warm-up:

- ``gemm``: one ``[m, 256] x [256, 128]`` bf16 product for each of ``--steps`` row counts m in a
  row (what a BellowsKV key GEMM sees as its latent count grows), plain and over
  ``row_bucket(m)`` rows;
- ``prefill``: qwen2.5-coder-0.5b prefills of ``--lengths`` distinct prompt lengths (100, 101, ...)
  with the prefill-sized linears as PyTorch computes them (``F.linear``) and as ``gemv`` mode does
  (``pask.cpu.bf16_matmul.bounded_linear``);
- ``bellows`` (with ``--projections``, a ``pask calibrate-bellows`` file of this model): one
  BellowsKV generation of ``--steps`` tokens from a ~1.8k-token prompt, its latent GEMMs over the
  latent count as it comes or bucketed; resident memory sampled every second: the sample a fifth
  into the run (past the prompt), the last one, and the growth between them.

Writes ``benchmarks/results/gemm_shapes.{json,md}`` through the shared writer (provenance).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results" / "gemm_shapes"


def rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 1e9


def run_gemm(bucketed: bool, steps: int) -> dict:
    import torch

    from pask.cpu.bf16_matmul import row_bucket

    w = torch.randn(256, 128, dtype=torch.bfloat16)
    with torch.inference_mode():
        torch.matmul(torch.randn(64, 256, dtype=torch.bfloat16), w)
        start = rss_gb()
        shapes = set()
        for m in range(1800, 1800 + steps):
            rows = row_bucket(m) if bucketed else m
            shapes.add(rows)
            torch.matmul(torch.zeros(rows, 256, dtype=torch.bfloat16), w)[:m]
    return {"growth_gb": rss_gb() - start, "shapes": len(shapes)}


def run_prefill(bucketed: bool, lengths: int) -> dict:
    import torch
    import torch.nn.functional as F

    from pask.cpu import bf16_matmul
    from pask.runtime.models import load_model

    lm = load_model("qwen2.5-coder-0.5b", dtype=torch.bfloat16)
    if not bucketed:
        bf16_matmul.bounded_linear = lambda x, w, b: F.linear(x, w, b)
    with torch.inference_mode():
        lm.model(input_ids=torch.randint(100, 5000, (1, 50)), logits_to_keep=1)
        start = rss_gb()
        for t in range(100, 100 + lengths):
            lm.model(input_ids=torch.randint(100, 5000, (1, t)), logits_to_keep=1)
    return {"growth_gb": rss_gb() - start, "linears": bf16_matmul.resolved()}


def run_bellows(bucketed: bool, projections: str, steps: int) -> dict:
    import torch

    import pask
    import pask.kv.cache
    from pask.runtime.models import load_model

    if not bucketed:
        pask.kv.cache.row_bucket = lambda m: m
    lm = load_model("qwen2.5-coder-0.5b", dtype=torch.bfloat16)
    text = " ".join(f"word{i % 97}" for i in range(900))
    msgs = [{"role": "user", "content": text + "\nRepeat all the words above, separated by spaces."}]
    samples, done = [], threading.Event()

    def sample() -> None:
        while not done.is_set():
            samples.append(rss_gb())
            time.sleep(1.0)

    threading.Thread(target=sample, daemon=True).start()
    out = pask.generate(
        lm, msgs, policy="bellows", policy_config={"projections": projections, "bits": 4}, max_new_tokens=steps
    )
    done.set()
    first = samples[len(samples) // 5]  # a fifth into the run: past the prompt
    return {"first_gb": first, "last_gb": samples[-1], "growth_gb": samples[-1] - first, "tokens": len(out.token_ids)}


def child(args) -> None:
    kind, bucketed = args.child, args.bucketed == "1"
    if kind == "gemm":
        res = run_gemm(bucketed, args.steps)
    elif kind == "prefill":
        res = run_prefill(bucketed, args.lengths)
    else:
        res = run_bellows(bucketed, args.projections, args.steps)
    print("RESULT " + json.dumps(res))


def spawn(args, kind: str, bucketed: bool) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, "--bucketed", "1" if bucketed else "0"]
    cmd += ["--steps", str(args.steps), "--lengths", str(args.lengths), "--threads", str(args.threads)]
    if args.projections:
        cmd += ["--projections", args.projections]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{kind} ({'bucketed' if bucketed else 'plain'}) failed:\n{out.stderr[-2000:]}")
    return json.loads(line.removeprefix("RESULT "))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, default=120)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--projections", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--bucketed", default="1", help=argparse.SUPPRESS)
    from pask.experiments.provenance import add_allow_dirty, check_clean, write_result

    add_allow_dirty(ap)
    args = ap.parse_args()
    if args.lengths < 1 or args.steps < 1 or args.threads < 1:
        ap.error("--lengths, --steps and --threads must be >= 1")
    if args.projections and not Path(args.projections).is_file():
        ap.error(f"--projections {args.projections} does not exist (make one with `pask calibrate-bellows`)")
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        return child(args)
    check_clean(args.out, args.allow_dirty)
    rows = []
    kinds = [("gemm", f"{args.steps} row counts of a [m, 256] x [256, 128] bf16 GEMM")]
    kinds.append(("prefill", f"{args.lengths} prefill lengths of qwen2.5-coder-0.5b"))
    if args.projections:
        kinds.append(("bellows", f"a BellowsKV generation of {args.steps} tokens"))
    for kind, what in kinds:
        for bucketed in (False, True):
            print(f"{kind} {'bucketed' if bucketed else 'plain'} ...", flush=True)
            rows.append({"kind": kind, "what": what, "bucketed": bucketed, **spawn(args, kind, bucketed)})
    md = ["| measurement | row counts | resident memory growth (GB) | detail |", "|---|---|---:|---|"]
    for r in rows:
        detail = {k: v for k, v in r.items() if k not in ("kind", "what", "bucketed", "growth_gb")}
        how = "bucketed" if r["bucketed"] else "as they come"
        md.append(f"| {r['what']} | {how} | {r['growth_gb']:.3f} | {detail} |")
    command = "python benchmarks/gemm_shapes.py " + shlex.join(sys.argv[1:])
    write_result(args.out, {"rows": rows, "args": vars(args)}, "\n".join(md) + "\n", command=command,
                 allow_dirty=args.allow_dirty)  # fmt: skip
    print("\n".join(md))


if __name__ == "__main__":
    main()
