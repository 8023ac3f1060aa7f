"""What the quantised weight formats start from and cost: the GGUF's tensor types, the re-quantisation
error of ``int8`` / ``int4`` against the converted bf16 weights, and the prefill's dequantisation speed.

    .venv/bin/python benchmarks/weights_format.py [--model qwen2.5-coder-0.5b] [--layers 4] [--threads 1]

Counts the GGUF tensors of the embedded model by quantisation type (the file is assembled from its
package parts into a temporary directory and read with ``gguf``); for the linear layers of the first
``--layers`` decoder layers and the LM head, the relative error ``|w_q - w| / |w|`` of each format
and the share of weights it reproduces exactly (after bf16 rounding); and the time to dequantise a
9728 x 896 weight (:func:`pask.cpu.native_gemv.dequant`, medians of 15). Writes
``benchmarks/results/weights_format.{json,md}``.
"""

from __future__ import annotations

import argparse
import collections
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from pask.cpu import native_gemv
from pask.cpu import weights as W
from pask.experiments.provenance import add_allow_dirty, check_clean, write_result
from pask.runtime import models as M

OUT = Path(__file__).resolve().parent / "results"


def gguf_types(name: str) -> dict[str, int]:
    import gguf

    reader = gguf.GGUFReader(str(M.embedded_gguf(name)))
    return dict(collections.Counter(t.tensor_type.name for t in reader.tensors).most_common())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    add_allow_dirty(ap)
    args = ap.parse_args()
    check_clean(OUT / "weights_format", args.allow_dirty)
    torch.set_num_threads(args.threads)
    types = gguf_types(args.model)
    lm = M.load_model(args.model)
    errors: dict[str, list[float]] = {"int8": [], "int4": []}
    exact: dict[str, list[float]] = {"int8": [], "int4": []}
    names = []
    for name, mod in lm.model.named_modules():
        keep = name == "lm_head" or any(f"layers.{i}." in name for i in range(args.layers))
        if isinstance(mod, torch.nn.Linear) and keep:
            names.append(name)
            w = mod.weight.detach()
            for fmt, bits in W.BITS.items():
                codes, sz = W.quantize(w, bits)
                deq = W.dequantize_reference(codes, sz, w.shape[0]).bfloat16()
                errors[fmt].append(float((deq.float() - w.float()).norm() / w.float().norm()))
                exact[fmt].append(float((deq == w).float().mean()))
    native_gemv.available()
    w = torch.randn(9728, 896, generator=torch.Generator().manual_seed(0)).bfloat16()
    dequant_ns = {}
    for fmt, bits in W.BITS.items():
        codes, sz = W.quantize(w, bits)
        ts = []
        for _ in range(15):
            t = time.perf_counter()
            native_gemv.dequant(codes, sz, w.shape[0], bits)
            ts.append(time.perf_counter() - t)
        dequant_ns[fmt] = statistics.median(ts) / w.numel() * 1e9
    command = "python benchmarks/weights_format.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    out = {
        "command": command,
        "model": args.model,
        "gguf_tensor_types": types,
        "layers": names,
        "relative_error": errors,
        "exact_share": exact,
        "dequant_ns_per_weight": dequant_ns,
        "threads": args.threads,
    }
    lines = [
        f"# {args.model}: what the quantised weight formats start from and cost",
        "",
        f"Command: `{command}`",
        "",
        "GGUF tensors by type: " + ", ".join(f"{k} {v}" for k, v in types.items()) + ".",
        "",
        f"Re-quantisation of the bf16 weights, {len(names)} linear layers (the first {args.layers} decoder "
        "layers and the LM head):",
        "",
        "| format | relative error, mean | max | weights reproduced exactly, mean |",
        "|---|---:|---:|---:|",
    ]
    for fmt in W.BITS:
        e, x = errors[fmt], exact[fmt]
        lines.append(f"| {fmt} | {statistics.mean(e):.4f} | {max(e):.4f} | {statistics.mean(x):.3f} |")
    lines += [
        "",
        f"Dequantising a 9728 x 896 weight ({args.threads} thread(s), median of 15): "
        + ", ".join(f"{k} {v:.3f} ns per weight" for k, v in dequant_ns.items())
        + ".",
    ]
    write_result(OUT / "weights_format", out, "\n".join(lines) + "\n", command=command, allow_dirty=args.allow_dirty)


if __name__ == "__main__":
    main()
