"""Which low-bit K/V layout a cheaper fourth tier should use: attention-output error per variant.

    .venv/bin/python benchmarks/low_bit_variants.py [--bfcl 2] [--sql 8] [--queries 16] [--threads 1]

Real dev prompts (BFCL: N per non-live category; text-to-SQL: the dev split's first M) on
qwen2.5-coder-0.5b in fp32. For every layer the prompt's keys (after RoPE) and values are
quantised outside the last ``queries + 8`` positions (the recent window of 8 stays exact), and the
last ``queries`` positions attend causally; the relative L2 error of the attention output (all
heads, all queries) against the exact one is averaged over layers and prompts. The quantiser is
the cache's own (:func:`pask.kv.quant.quantize_codes`): asymmetric min-max per group of 32 along
head_dim with a bf16 scale and zero, keys balanced per channel first
(:func:`pask.kv.storage.key_balance`). Alternatives: a 64-point Hadamard rotation before
quantising (``had``), and KIVI's keys, per channel over groups of 32 tokens (``kivi``).
``cost``: bytes per token over BF16 (codes plus scales and zeros). A pure-tensor simulation of
the tier layouts (no cache, no kernels): it ranks layouts before one is built. Writes
``benchmarks/results/low_bit_variants.{json,md}``.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from pathlib import Path

import torch
from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

from pask.evaluation.run_bfcl import prepare as prepare_bfcl
from pask.evaluation.run_sql import prepare as prepare_sql
from pask.experiments.provenance import add_allow_dirty, check_clean, write_result
from pask.kv.quant import dequantize_codes, lowbit_bytes_per_vector, quantize_codes
from pask.kv.storage import key_balance
from pask.runtime.models import load_model
from pask.tasks import get_task
from pask.tasks.function_calling import NON_LIVE, load_cases

OUT = Path(__file__).resolve().parent / "results"
GROUP, WINDOW = 32, 8
#: name -> (key bits, value bits, key mode, value mode); 16 bits = kept exact
VARIANTS = {
    "K4V4 (INT4 tier)": (4, 4, "bal", "tok"),
    "K2V2 (INT2 tier)": (2, 2, "bal", "tok"),
    "K2V2 had": (2, 2, "had", "had"),
    "K2V2 kivi keys": (2, 2, "kivi", "tok"),
    "K4V2": (4, 2, "bal", "tok"),
    "K4V2 had values": (4, 2, "bal", "had"),
    "K2V4": (2, 4, "bal", "tok"),
    "K16V2 (exact keys)": (16, 2, "bal", "tok"),
    "K2V16 (exact values)": (2, 16, "bal", "tok"),
    "release": (0, 0, "", ""),  # the quantised positions dropped (attention over the rest)
}


def minmax(x: torch.Tensor, bits: int, group: int = GROUP) -> torch.Tensor:
    """Round trip through the cache's quantiser (:func:`pask.kv.quant.quantize_codes`, bf16 scale and
    zero per ``group`` values along the last dim)."""
    return dequantize_codes(*quantize_codes(x, group, scale_dtype=torch.bfloat16, bits=bits))


def hadamard(d: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


def round_trip(x: torch.Tensor, bits: int, mode: str, key: bool) -> torch.Tensor:
    """``x [1, Hkv, n, D]`` after quantisation with ``bits`` in ``mode`` (16: unchanged)."""
    if bits == 16:
        return x
    if mode == "kivi":  # per channel over groups of GROUP tokens (the last, partial group as it is)
        n = x.shape[-2]
        out = []
        for i in range(0, n, GROUP):
            c = x[..., i : i + GROUP, :].transpose(-1, -2)
            m = c.shape[-1]  # an odd last group repeats its last token (same min / max) to pack
            c = torch.cat([c, c[..., -1:]], -1) if m % 2 else c
            out.append(minmax(c, bits, c.shape[-1])[..., :m].transpose(-1, -2))
        return torch.cat(out, -2)
    mid, bal = torch.zeros(()), torch.ones(())
    if key:  # per-channel balance, as the cache does for keys
        mid, bal = key_balance(x[0])[:, :, None].unbind(1)
    y = (x - mid) / bal
    if mode == "had":
        h = hadamard(x.shape[-1])
        y = minmax(y @ h, bits) @ h.T
    else:
        y = minmax(y, bits)
    return y * bal + mid


def cost(kb: int, vb: int, head_dim: int = 64) -> float:
    """Bytes per token over BF16 (:func:`pask.kv.quant.lowbit_bytes_per_vector`; exact: 1, released: 0)."""

    def side(b: int) -> float:
        return (
            {16: 1.0, 0: 0.0}.get(b) if b in (0, 16) else lowbit_bytes_per_vector(head_dim, GROUP, b) / (2 * head_dim)
        )

    return (side(kb) + side(vb)) / 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--bfcl", type=int, default=2, help="BFCL dev prompts per non-live category")
    ap.add_argument("--sql", type=int, default=8, help="text-to-SQL dev prompts")
    ap.add_argument("--queries", type=int, default=16, help="last prompt positions used as queries")
    ap.add_argument("--threads", type=int, default=1)
    add_allow_dirty(ap)
    args = ap.parse_args()
    check_clean(OUT / "low_bit_variants", args.allow_dirty)
    torch.set_num_threads(args.threads)
    lm = load_model(args.model, dtype=torch.float32)
    model = lm.model
    reqs = [prepare_bfcl(lm, c, 16)[0] for c in load_cases(list(NON_LIVE), split="dev", limit=args.bfcl)]
    reqs += [prepare_sql(lm, c, 16)[0] for c in get_task("sql").cases("dev", args.sql)]
    seen: dict[int, tuple] = {}

    def hook(i):
        def grab(_mod, _args, kwargs):
            seen[i] = (kwargs["hidden_states"], kwargs["position_embeddings"])

        return grab

    layers = model.model.layers
    handles = [layer.self_attn.register_forward_pre_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    errs: dict[str, list[float]] = {name: [] for name in VARIANTS}
    nq = args.queries
    with torch.no_grad():
        for req in reqs:
            model(torch.tensor([req.prompt_ids]))
            for i, layer in enumerate(layers):
                x, (cos, sin) = seen[i]
                att, n = layer.self_attn, x.shape[1]
                hd = att.head_dim
                q, k, v = (p(x).view(1, n, -1, hd).transpose(1, 2) for p in (att.q_proj, att.k_proj, att.v_proj))
                q, k = apply_rotary_pos_emb(q, k, cos, sin)
                q, rep, cut = q[:, :, -nq:], q.shape[1] // k.shape[1], n - nq - WINDOW
                mask = torch.arange(n)[None, :] > torch.arange(n - nq, n)[:, None]

                def attend(kk, vv, q=q, rep=rep, mask=mask, hd=hd):
                    s = q @ kk.repeat_interleave(rep, 1).transpose(-1, -2) / math.sqrt(hd)
                    s = s.masked_fill(mask[:, -kk.shape[-2] :], float("-inf"))
                    return torch.softmax(s, -1) @ vv.repeat_interleave(rep, 1)

                ref = attend(k, v)
                for name, (kb, vb, km, vm) in VARIANTS.items():
                    if kb == 0:
                        errs[name].append(((attend(k[:, :, cut:], v[:, :, cut:]) - ref).norm() / ref.norm()).item())
                        continue
                    k2 = torch.cat([round_trip(k[:, :, :cut], kb, km, True), k[:, :, cut:]], 2)
                    v2 = torch.cat([round_trip(v[:, :, :cut], vb, vm, False), v[:, :, cut:]], 2)
                    errs[name].append(((attend(k2, v2) - ref).norm() / ref.norm()).item())
    for h in handles:
        h.remove()
    command = "python benchmarks/low_bit_variants.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    mean = {name: sum(e) / len(e) for name, e in errs.items()}
    result = {
        "command": command,
        "model": lm.name,
        "prompts": len(reqs),
        "queries": nq,
        "variants": {
            name: {"key_bits": kb, "value_bits": vb, "key_mode": km, "value_mode": vm, "cost": cost(kb, vb)}
            for name, (kb, vb, km, vm) in VARIANTS.items()
        },
        "mean_rel_error": mean,
        "per_layer_prompt": errs,
    }
    lines = [
        f"# Low-bit K/V layouts: attention-output error ({lm.name}, fp32)",
        "",
        f"Command: `{command}`  ",
        f"{len(reqs)} dev prompts ({args.bfcl} per non-live BFCL category, {args.sql} text-to-SQL); the last {nq} "
        f"positions attend, everything before the recent window of {WINDOW} is quantised. Relative L2 error of the "
        "attention output against exact K/V, mean over layers and prompts. `bal`: keys balanced per channel "
        "(the cache's quantiser), `had`: 64-point Hadamard rotation before quantising, `kivi`: keys per channel "
        "over groups of 32 tokens. A pure-tensor simulation of tier layouts, not a cache.",
        "",
        "| variant | key bits / mode | value bits / mode | cost (x BF16) | mean rel. error |",
        "|---|---|---|---:|---:|",
    ]
    for name, (kb, vb, km, vm) in VARIANTS.items():
        ks = {16: "exact", 0: "released"}.get(kb, f"{kb} / {km}")
        vs = {16: "exact", 0: "released"}.get(vb, f"{vb} / {'per token' if vm == 'tok' else vm}")
        lines.append(f"| {name} | {ks} | {vs} | {cost(kb, vb):.4f} | {mean[name]:.3f} |")
    md = "\n".join(lines) + "\n"
    write_result(OUT / "low_bit_variants", result, md, command=command, allow_dirty=args.allow_dirty)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
