"""Fused CPU decode attention for BF16 caches (head_dim 64, group 32), built on PyTorch's own CPU kernels.

* H stream: ``aten._scaled_dot_product_flash_attention_for_cpu`` over the BF16 tier, which also
  returns the log-sum-exp needed to merge streams.
* INT4 stream, keys: ``aten._weight_int4pack_mm_for_cpu`` computes ``q @ dequant(K)^T`` straight
  from the packed codes: the L tier stores key codes in that kernel's weight layout (64-slot blocks,
  d-major; see ``_BlockedCodes``) with a per (token, group) scale and zero.
* INT4 stream, values: the same kernel with the roles swapped, once per (head, scale group). Value
  codes of a group are stored token-major as adjacent pairs, the kernel's layout for a
  ``[g=32, tokens]`` weight; the per-token scale is folded into the probabilities and the
  per-token zero is a small matmul: ``sum_t p_t v_t[d] = sum_t (p_t s_t,g) c_t[d] + sum_t p_t z_t,g``.

Both streams merge in one FP32 online softmax. The path applies only when a start-up probe finds
the kernels and confirms their packing and dequantisation match ours (the AVX-512 build);
otherwise the reference path of :mod:`pask.kv.attention` runs. Precision is BF16-level: the
kernel takes BF16 scales/zeros and returns BF16 scores and partial outputs.
"""

from __future__ import annotations

import torch

from pask.kv.quant import pack_pairs
from pask.kv.storage import BLOCK, _BlockedCodes, _SeqStore

_AVAILABLE: bool | None = None
_ONES: torch.Tensor | None = None  # unit scale / zero-point 8 for the value GEMM: dequant(c) = c


def _ops():
    return (
        torch.ops.aten._convert_weight_to_int4pack_for_cpu,
        torch.ops.aten._weight_int4pack_mm_for_cpu,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
    )


def _probe() -> bool:
    try:
        convert, mm, flash = _ops()
        gen = torch.Generator().manual_seed(0)
        codes = torch.randint(0, 16, (2 * BLOCK, 64), generator=gen, dtype=torch.int32)
        theirs = convert(codes, 1)
        mine = _BlockedCodes(64).alloc(1, 2 * BLOCK, "cpu")
        _BlockedCodes(64).write_slots(mine, torch.arange(2 * BLOCK), codes.to(torch.uint8)[None])
        if theirs.numel() != mine.numel() or not torch.equal(theirs.reshape(-1), mine.reshape(-1)):
            return False
        vcodes = torch.randint(0, 16, (32, 2 * BLOCK), generator=gen, dtype=torch.int32)  # [g, tokens]
        if not torch.equal(convert(vcodes, 1).reshape(-1), pack_pairs(vcodes.T).reshape(-1)):
            return False
        x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
        sz = torch.rand(2, 2 * BLOCK, 2, generator=gen).to(torch.bfloat16)
        got = mm(x, theirs, 32, sz).float()
        scale, zero = sz[..., 0].float().T[..., None], sz[..., 1].float().T[..., None]
        w = (codes.float() - 8).view(2 * BLOCK, 2, 32) * scale + zero
        want = x.float() @ w.view(2 * BLOCK, 64).T
        q = torch.randn(1, 2, 3, 64, generator=gen)
        _, lse = flash(q, q, q, 0.0, False, scale=0.125)
        return bool(torch.allclose(got, want, atol=0.05 * float(want.abs().max()))) and lse.shape == (1, 2, 3)
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def available() -> bool:
    """Whether PyTorch's CPU int4 GEMM and flash kernels are present and match our layout (cached)."""
    global _AVAILABLE
    if _AVAILABLE is None:
        _AVAILABLE = _probe()
    return _AVAILABLE


def applies(q: torch.Tensor, store: _SeqStore) -> bool:
    """Whether :func:`decode_attention` serves this query and store."""
    h = store.h.parts["k"]
    return (
        q.device.type == "cpu"
        and q.dtype == torch.bfloat16
        and h.dtype == torch.bfloat16
        and q.shape[-1] == 64
        and store.group == 32
        and store.l2.n == 0
        and available()
    )


def _ones(rows: int, cols: int) -> torch.Tensor:
    """Scale 1 / zero 8 for a [cols, rows * 64] weight: the value GEMM then sums raw codes."""
    global _ONES
    if _ONES is None or _ONES.shape[0] < rows or _ONES.shape[1] != cols:
        _ONES = torch.empty(max(rows, 512), cols, 2, dtype=torch.bfloat16)
        _ONES[..., 0] = 1.0
        _ONES[..., 1] = 8.0
    return _ONES[:rows]


def int4_stream(qg: torch.Tensor, store: _SeqStore, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``qg [Hkv, grp, 64]`` (bf16) over the L tier: (normalised output fp32, log-sum-exp)."""
    _, mm, _ = _ops()
    hkv, grp, d = qg.shape
    n = store.l.n
    nb = -(-n // BLOCK) * BLOCK  # whole blocks; slots past n hold finite stale/zero data
    g = store.group
    ng = d // g
    t = store.l.t
    sz = t["ksz"][:, :, :nb]  # per head [G, nb, 2]: contiguous copy below when nb < capacity
    kq = t["kq"].reshape(hkv, -1)[:, : nb * d // 2]
    # balanced keys (k = k' * bal + mid): q.k = (q * bal).k' + q.mid, the second term one constant per query row
    mid, bal = store.kbal[:, 0], store.kbal[:, 1]  # [Hkv, D]
    qs = (qg.float() * bal[:, None] * scaling).to(torch.bfloat16)
    const = (qg.float() * mid[:, None]).sum(-1) * scaling  # [Hkv, grp]
    s = torch.stack([mm(qs[h], kq[h].view(nb, d // 2), g, sz[h].contiguous()) for h in range(hkv)]).float()
    s = s + const[..., None]
    s[..., n:] = -torch.inf  # slots past n pad the last block
    p = torch.softmax(s, dim=-1, dtype=torch.float32)  # normalised, FP32
    # log-sum-exp from the max element: p_max = exp(s_max - lse) >= 1/n, so no precision is lost
    p_max, arg = p.max(dim=-1)
    lse = s.gather(-1, arg[..., None])[..., 0] - torch.log(p_max)
    pb = p.to(torch.bfloat16)
    x = pb[:, None] * t["vs"][:, :, None, :nb]  # [Hkv, G, grp, nb] bf16: p_t * scale_t,g
    ones = _ones(nb // BLOCK, g)
    # value GEMM per (head, group): B checked as [N, K/2] = [g, nb/2]; bytes are the [nb, g/2] codes
    vq = t["vq"]
    part = torch.stack(
        [mm(x[h, j], vq[h, j, :nb].view(g, nb // 2), BLOCK, ones) for h in range(hkv) for j in range(ng)]
    )
    part = part.view(hkv, ng, grp, g)
    o = part.float().permute(0, 2, 1, 3).reshape(hkv, grp, d)
    zt = torch.matmul(p, t["vz"][:, :, :nb].float().transpose(1, 2))  # [Hkv, grp, G]: sum_t p_t zero_t,g
    return o + zt.repeat_interleave(g, dim=-1), lse


def merge_streams(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Merge normalised stream outputs ``[Hkv, rows, D]`` by their log-sum-exps ``[Hkv, rows]`` (FP32)."""
    if len(parts) == 1:
        return parts[0][0].float()
    m = torch.stack([lse for _, lse in parts]).amax(dim=0)
    acc, total = 0.0, 0.0
    for out, lse in parts:
        w = torch.exp(lse - m)
        acc = acc + w[..., None] * out.float()
        total = total + w
    return acc / total[..., None]


def decode_attention(q: torch.Tensor, store: _SeqStore, scaling: float) -> torch.Tensor:
    """One query token ``q [Hq, 1, 64]`` (bf16) over the H and INT4 tiers -> ``[1, Hq, 64]``."""
    _, _, flash = _ops()
    hq, _, d = q.shape
    hkv = store.h.heads
    qg = q.reshape(hkv, hq // hkv, d)
    parts = []
    if store.h.n:
        out, lse = flash(qg[None], store.h.view("k")[None], store.h.view("v")[None], 0.0, False, scale=scaling)
        parts.append((out[0], lse[0]))
    if store.l.n:
        parts.append(int4_stream(qg, store, scaling))
    return merge_streams(parts).reshape(1, hq, d).to(q.dtype)
