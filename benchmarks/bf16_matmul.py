"""BF16 model speed with native bf16 GEMMs vs fp32 products (``pask.bf16_matmul``) on this CPU.

    .venv/bin/python benchmarks/bf16_matmul.py [--model qwen2.5-coder-0.5b] [--prompt 512] [--threads 2]

Loads the model in bf16 twice (``PASK_BF16_MATMUL=native`` and ``fp32``) and times, interleaved,
a prefill of ``--prompt`` tokens (batch 1) and a decode step at batch 8 over ``--context`` cached
tokens; also the largest logit difference of the prefill between the two modes and whether the
greedy token agrees. Writes ``benchmarks/results/bf16_matmul.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from pask import bf16_matmul
from pask.models import load_model

OUT = Path(__file__).resolve().parent / "results"


def _time(fn, repeats: int) -> float:
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 20000, (1, args.prompt), generator=gen)
    ctx = torch.randint(100, 20000, (8, args.context), generator=gen)
    step = torch.randint(100, 20000, (8, 1), generator=gen)
    models = {}
    for how in ("native", "fp32"):
        lm = load_model(args.model, dtype=torch.bfloat16)
        for mod in lm.model.modules():  # load_model applied the auto mode: start from native
            mod.__dict__.pop("forward", None)
        bf16_matmul.apply(lm.model, how)
        models[how] = lm.model
    rows, logits = {}, {}
    with torch.inference_mode():
        for how, m in models.items():
            logits[how] = m(input_ids=ids, logits_to_keep=1).logits[0, -1].float()
            cache = m(input_ids=ctx, use_cache=True).past_key_values
            rows[how] = {"cache": cache}
        for _ in range(args.repeats):  # interleaved: machine drift hits both modes alike
            for how, m in models.items():
                r = rows[how]
                r.setdefault("prefill", []).append(_time(lambda m=m: m(input_ids=ids, logits_to_keep=1), 1))
                r.setdefault("step", []).append(
                    _time(lambda m=m, r=r: m(input_ids=step, cache=r["cache"], use_cache=False), 1)
                )
    res = {
        how: {"prefill_s": statistics.median(r["prefill"]), "decode_step_ms": 1e3 * statistics.median(r["step"])}
        for how, r in rows.items()
    }
    diff = float((logits["native"] - logits["fp32"]).abs().max())
    same = int(logits["native"].argmax()) == int(logits["fp32"].argmax())
    command = "python benchmarks/bf16_matmul.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    out = {
        "command": command,
        "model": args.model,
        "prompt": args.prompt,
        "context": args.context,
        "threads": args.threads,
        "cpu": platform.processor() or platform.machine(),
        "torch_cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
        "cpu_bf16": bf16_matmul.cpu_has_bf16(),
        "modes": res,
        "max_logit_diff": diff,
        "same_greedy_token": same,
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "bf16_matmul.json").write_text(json.dumps(out, indent=2) + "\n")
    n, f = res["native"], res["fp32"]
    lines = [
        f"# bf16 {args.model}: native bf16 GEMMs vs fp32 products ({args.threads} threads)",
        "",
        f"Command: `{command}`  ",
        f"CPU capability {out['torch_cpu_capability']}, BF16 arithmetic: {out['cpu_bf16']}. Medians of "
        f"{args.repeats} interleaved runs.",
        "",
        "| mode | prefill of " + str(args.prompt) + " tokens (s) | decode step, batch 8 (ms) |",
        "|---|---:|---:|",
        f"| native bf16 | {n['prefill_s']:.2f} | {n['decode_step_ms']:.1f} |",
        f"| fp32 products | {f['prefill_s']:.2f} | {f['decode_step_ms']:.1f} |",
        f"| speed-up | {n['prefill_s'] / f['prefill_s']:.2f}x | {n['decode_step_ms'] / f['decode_step_ms']:.2f}x |",
        "",
        f"Largest logit difference of the prefill: {diff:.3f}; same greedy token: {same}. Decode steps "
        f"(8 rows < {bf16_matmul.MIN_ROWS}) keep the native GEMV in both modes.",
    ]
    (OUT / "bf16_matmul.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
