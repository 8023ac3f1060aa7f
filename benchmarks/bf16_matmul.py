"""BF16 model speed with native bf16 GEMMs vs fp32 products (``pask.cpu.bf16_matmul``) on this CPU.

    .venv/bin/python benchmarks/bf16_matmul.py [--model qwen2.5-coder-0.5b] [--prompt 512] [--threads 2]

Loads the model in bf16 once per mode (``PASK_BF16_MATMUL=native``, ``fp32``, ``fp32-weights`` and,
on CPUs with AVX512-BF16, ``gemv``; ``fp32-weights`` also with the native gemv of
:mod:`pask.cpu.native_gemv` switched off, i.e.
PyTorch's GEMV on the fp32 weight copy for decode steps) and times, interleaved, a prefill of
``--prompt`` tokens (batch 1) and decode steps at each of ``--batches`` over ``--context`` cached
tokens; also the largest logit difference of the prefill against the native mode and whether the
greedy token agrees. Writes
``benchmarks/results/bf16_matmul.{json,md}``.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from pask.cpu import bf16_matmul, native_gemv
from pask.experiments.provenance import add_allow_dirty, check_clean, write_result
from pask.runtime.models import load_model

OUT = Path(__file__).resolve().parent / "results"


def _time(fn, repeats: int) -> float:
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


@contextlib.contextmanager
def _gemv(name: str):
    """The ``-torch`` modes run with the native gemv off (PyTorch's GEMV for decode steps)."""
    saved = native_gemv.MAX_ROWS
    native_gemv.MAX_ROWS = 0 if name.endswith("-torch") else saved
    try:
        yield
    finally:
        native_gemv.MAX_ROWS = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="8,16", help="decode batch sizes, comma-separated")
    add_allow_dirty(ap)
    args = ap.parse_args()
    check_clean(OUT / "bf16_matmul", args.allow_dirty)
    batches = [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 20000, (1, args.prompt), generator=gen)
    ctx = torch.randint(100, 20000, (max(batches), args.context), generator=gen)
    step = torch.randint(100, 20000, (max(batches), 1), generator=gen)
    models = {}
    modes = {"native": "native", "fp32": "fp32", "fp32-weights": "fp32-weights", "fp32-weights-torch": "fp32-weights"}
    if bf16_matmul.cpu_has_bf16() and native_gemv.has_bf16_io():
        modes["gemv"] = "gemv"
    for name, how in modes.items():
        lm = load_model(args.model, dtype=torch.bfloat16)
        for mod in lm.model.modules():  # load_model applied the auto mode: start from native
            mod.__dict__.pop("forward", None)
        bf16_matmul.apply(lm.model, how)
        bf16_matmul.apply_gemv(lm.model, how)
        models[name] = lm.model
    rows, logits = {}, {}
    with torch.inference_mode():
        for how, m in models.items():
            with _gemv(how):
                logits[how] = m(input_ids=ids, logits_to_keep=1).logits[0, -1].float()
                rows[how] = {"cache": {b: m(input_ids=ctx[:b], use_cache=True).past_key_values for b in batches}}
        for _ in range(args.repeats):  # interleaved: machine drift hits every mode alike
            for how, m in models.items():
                r = rows[how]
                with _gemv(how):
                    r.setdefault("prefill", []).append(_time(lambda m=m: m(input_ids=ids, logits_to_keep=1), 1))
                    for b in batches:
                        r.setdefault(b, []).append(
                            _time(lambda m=m, c=r["cache"][b], b=b: m(input_ids=step[:b], cache=c, use_cache=False), 1)
                        )
    res = {
        how: {
            "prefill_s": statistics.median(r["prefill"]),
            "decode_step_ms": {str(b): 1e3 * statistics.median(r[b]) for b in batches},
        }
        for how, r in rows.items()
    }
    diff = {h: float((logits["native"] - logits[h]).abs().max()) for h in models if h != "native"}
    same = {h: int(logits["native"].argmax()) == int(logits[h].argmax()) for h in models if h != "native"}
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
        "native_gemv": native_gemv.status(),
        "modes": res,
        "max_logit_diff": diff,
        "same_greedy_token": same,
    }
    n = res["native"]
    names = {
        "native": "native bf16",
        "fp32": f"fp32 products (`fp32`{'' if out['cpu_bf16'] else ', `auto` here'}), native gemv",
        "fp32-weights": "fp32 weight copy, native gemv",
        "fp32-weights-torch": "fp32 weight copy, PyTorch GEMV",
        "gemv": "native bf16 GEMMs, bf16 GEMV for decode steps (`gemv`)",
    }
    head = f"| mode | prefill of {args.prompt} tokens (s) | " + " | ".join(
        f"decode step, batch {b} (ms)" for b in batches
    )
    lines = [
        f"# bf16 {args.model}: native bf16 GEMMs vs fp32 products ({args.threads} threads)",
        "",
        f"Command: `{command}`  ",
        f"CPU capability {out['torch_cpu_capability']}, BF16 arithmetic: {out['cpu_bf16']}. Medians of "
        f"{args.repeats} interleaved runs; speed-ups against native bf16 in brackets; decode steps over "
        f"{args.context} cached tokens.",
        "",
        head + " | largest prefill logit difference vs native | same greedy token |",
        "|---|---:|" + "---:|" * len(batches) + "---:|---|",
    ]
    for how, r in res.items():
        cells = [f"{r['prefill_s']:.2f} ({n['prefill_s'] / r['prefill_s']:.2f}x)"] + [
            f"{r['decode_step_ms'][str(b)]:.1f} ({n['decode_step_ms'][str(b)] / r['decode_step_ms'][str(b)]:.2f}x)"
            for b in batches
        ]
        extra = ["", ""] if how == "native" else [f"{diff[how]:.3f}", str(same[how])]
        lines.append(f"| {names[how]} | " + " | ".join(cells + extra) + " |")
    lines += [
        "",
        f"Decode steps (at most {native_gemv.MAX_ROWS} rows) go to the native bf16-weight gemv "
        f"(`pask/cpu/native_gemv.cpp`, status: {out['native_gemv']}) in `fp32` and `fp32-weights`; "
        "`fp32-weights` keeps an fp32 copy of every linear weight (3x the weight memory) for the other "
        "inputs; the `PyTorch GEMV` row switches the native gemv off, so its decode steps use the fp32 "
        "copy (the mode before the native gemv). `gemv` (CPUs with AVX512-BF16): PyTorch's bf16 GEMM "
        f"for prefills, the native bf16-in/out GEMV ({native_gemv.isa()}) for decode steps.",
    ]
    write_result(OUT / "bf16_matmul", out, "\n".join(lines) + "\n", command=command, allow_dirty=args.allow_dirty)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
