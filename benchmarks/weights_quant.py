"""Decode steps with INT8 / INT4 weights (``--weights``, :mod:`pask.cpu.weights`) against bf16 weights.

    .venv/bin/python benchmarks/weights_quant.py [--model qwen2.5-coder-0.5b] [--threads 2]

Loads the model once per format (bf16, int8, int4; each in the mode ``auto`` gives this CPU) and times,
interleaved, a prefill of ``--prompt`` tokens (batch 1) and decode steps at each of ``--batches`` over
``--context`` cached tokens (Full KV); also the bytes of weights a decode step reads
(:func:`pask.cpu.weights.step_weight_bytes`), the largest logit difference of the prefill and whether
the greedy token agrees with bf16's on ``--prompts`` random prompts. Writes
``benchmarks/results/weights_quant.{json,md}``. Accuracy on the tasks is measured by sweeps
(``benchmarks/weights-*.toml``), not here.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from pask.cpu import bf16_matmul, native_gemv
from pask.cpu.weights import step_weight_bytes
from pask.experiments.provenance import add_allow_dirty, check_clean, write_result
from pask.runtime.capacity import kv_bytes_per_token
from pask.runtime.models import load_model

OUT = Path(__file__).resolve().parent / "results"


def _once(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,8,16", help="decode batch sizes, comma-separated")
    ap.add_argument("--prompts", type=int, default=16, help="random prompts for the greedy-token agreement")
    add_allow_dirty(ap)
    args = ap.parse_args()
    check_clean(OUT / "weights_quant", args.allow_dirty)
    batches = [int(b) for b in args.batches.split(",")]
    if any(not 1 <= b <= native_gemv.MAX_ROWS for b in batches):
        raise SystemExit(f"--batches: decode batches of 1..{native_gemv.MAX_ROWS} rows")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 20000, (1, args.prompt), generator=gen)
    ctx = torch.randint(100, 20000, (max(batches), args.context), generator=gen)
    step = torch.randint(100, 20000, (max(batches), 1), generator=gen)
    probes = torch.randint(100, 20000, (args.prompts, 64), generator=gen)
    models = {w: load_model(args.model, dtype=torch.bfloat16, weights=w) for w in ("bf16", "int8", "int4")}
    rows, logits, greedy = {}, {}, {}
    with torch.inference_mode():
        for w, lm in models.items():
            m = lm.model
            logits[w] = m(input_ids=ids, logits_to_keep=1).logits[0, -1].float()
            greedy[w] = m(input_ids=probes, logits_to_keep=1).logits[:, -1].argmax(-1)
            rows[w] = {"cache": {b: m(input_ids=ctx[:b], use_cache=True).past_key_values for b in batches}}
        for _ in range(args.repeats):  # interleaved: machine drift hits both alike
            for w, lm in models.items():
                m, r = lm.model, rows[w]
                r.setdefault("prefill", []).append(_once(lambda m=m: m(input_ids=ids, logits_to_keep=1)))
                for b in batches:
                    c = r["cache"][b]
                    r.setdefault(b, []).append(
                        _once(lambda m=m, c=c, b=b: m(input_ids=step[:b], cache=c, use_cache=False))
                    )
    res = {
        w: {
            "step_weight_bytes": step_weight_bytes(models[w].model),
            "prefill_s": statistics.median(rows[w]["prefill"]),
            "decode_step_ms": {str(b): 1e3 * statistics.median(rows[w][b]) for b in batches},
        }
        for w in models
    }
    # gain share: (speed-up - 1) / (limit - 1), the limit from the bytes a step reads (weights + Full KV held)
    per_token = kv_bytes_per_token(models["bf16"].model.config, torch.bfloat16)
    for w in ("int8", "int4"):
        res[w]["gain_share"] = {}
        for b in batches:
            kv = b * args.context * per_token
            limit = (res["bf16"]["step_weight_bytes"] + kv) / (res[w]["step_weight_bytes"] + kv)
            speedup = res["bf16"]["decode_step_ms"][str(b)] / res[w]["decode_step_ms"][str(b)]
            res[w]["gain_share"][str(b)] = {"limit": limit, "speedup": speedup, "share": (speedup - 1) / (limit - 1)}
    agree = {w: int((greedy["bf16"] == greedy[w]).sum()) for w in ("int8", "int4")}
    command = "python benchmarks/weights_quant.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    out = {
        "command": command,
        "model": args.model,
        "prompt": args.prompt,
        "context": args.context,
        "threads": args.threads,
        "repeats": args.repeats,
        "bf16_matmul": bf16_matmul.resolved(),
        "quant_kernel": native_gemv.quant_kernel(),
        "gemv_isa": native_gemv.isa(),
        "quant_layers": models["int4"].model.pask_weights["layers"],
        "weights": res,
        "max_prefill_logit_diff": {w: float((logits["bf16"] - logits[w]).abs().max()) for w in ("int8", "int4")},
        "greedy_agree": agree,
        "prompts": args.prompts,
    }
    b16 = res["bf16"]
    lines = [
        f"# {args.model}: INT8 / INT4 weights against bf16 ({args.threads} threads)",
        "",
        f"Command: `{command}`  ",
        f"Quantised decode kernel: {out['quant_kernel']} ({out['quant_layers']} linear layers, LM head included); "
        f"bf16 mode `{out['bf16_matmul']}`. Medians of {args.repeats} interleaved runs; decode steps with "
        f"Full KV over {args.context} cached tokens; speed-ups against bf16 in brackets.",
        "",
        "| weights | weight bytes a step reads | prefill of "
        + f"{args.prompt} tokens (s) | "
        + " | ".join(f"decode step, batch {b} (ms)" for b in batches)
        + " |",
        "|---|---:|---:|" + "---:|" * len(batches),
    ]
    for w, r in res.items():
        cells = [
            f"{r['step_weight_bytes'] / 1e6:.1f} MB",
            f"{r['prefill_s']:.2f} ({b16['prefill_s'] / r['prefill_s']:.2f}x)",
        ]
        cells += [
            f"{r['decode_step_ms'][str(b)]:.1f} ({b16['decode_step_ms'][str(b)] / r['decode_step_ms'][str(b)]:.2f}x)"
            for b in batches
        ]
        lines.append(f"| {w} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Gain share of the decode steps, (speed-up - 1) / (limit - 1), with the limit from the bytes a step reads "
        "(the weights above plus the Full KV held):",
        "",
        "| weights | " + " | ".join(f"batch {b}: limit, gain share" for b in batches) + " |",
        "|---|" + "---:|" * len(batches),
    ]
    for w in ("int8", "int4"):
        g = res[w]["gain_share"]
        cells = [f"{g[str(b)]['limit']:.2f}x, {100 * g[str(b)]['share']:.0f} %" for b in batches]
        lines.append(f"| {w} | " + " | ".join(cells) + " |")
    lines.append("")
    for w in ("int8", "int4"):
        lines.append(
            f"- {w}: largest logit difference of the prefill's last token against bf16 "
            f"{out['max_prefill_logit_diff'][w]:.3f}; the greedy next token agrees on {agree[w]} of {args.prompts} "
            f"random 64-token prompts; a step reads {res[w]['step_weight_bytes'] / b16['step_weight_bytes']:.3f}x "
            "the bytes of bf16 (codes and scales of every linear layer, norms; not the embedding table)."
        )
    write_result(OUT / "weights_quant", out, "\n".join(lines) + "\n", command=command, allow_dirty=args.allow_dirty)


if __name__ == "__main__":
    main()
