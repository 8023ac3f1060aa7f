"""Decode attention over a TieredCache sequence store as one Triton kernel.

Same math as :func:`pask.kv.attention.tiered_attention_reference` for one query token: one
program per kv head loads the ``Hq/Hkv`` query rows of its GQA group (no K/V repetition), walks
the H tier then the INT4 tier in ``BLOCK_N``-token blocks, dequantises INT4 keys (blocked
d-major codes, zero point 8, then the per-channel key balance) and values (per-group adjacent
pairs) in registers, and keeps one FP32 online softmax (running max, running sum, running output) across both streams.

On a machine without a GPU the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``,
set before triton is imported); that is how the tests check it against the torch reference.
"""

from __future__ import annotations

import os

import torch

from pask.errors import PaskError

try:  # optional dependency
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None


def available() -> bool:
    """Whether triton can be imported."""
    return triton is not None


if triton is not None:

    @triton.jit
    def _decode_kernel(
        q_ptr,
        out_ptr,
        kh_ptr,
        vh_ptr,
        kq_ptr,
        ksz_ptr,
        kbal_ptr,
        vq_ptr,
        vs_ptr,
        vz_ptr,
        n_h,
        n_l,
        stride_h_head,  # elements between heads in kh / vh
        cap_l,  # INT4 tier capacity (slots)
        scaling,
        GRP: tl.constexpr,
        GRP_P: tl.constexpr,
        D: tl.constexpr,
        QG: tl.constexpr,  # quantisation group along D
        BLOCK_N: tl.constexpr,
    ):
        h = tl.program_id(0)
        rows = tl.arange(0, GRP_P)
        d = tl.arange(0, D)
        row_ok = rows < GRP
        q = tl.load(q_ptr + (h * GRP + rows)[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        m = tl.full((GRP_P,), float("-inf"), tl.float32)
        lsum = tl.zeros((GRP_P,), tl.float32)
        acc = tl.zeros((GRP_P, D), tl.float32)
        # H stream
        for start in range(0, n_h, BLOCK_N):
            t = start + tl.arange(0, BLOCK_N)
            ok = t < n_h
            off = h * stride_h_head + t[:, None] * D + d[None, :]
            k = tl.load(kh_ptr + off, mask=ok[:, None], other=0.0).to(tl.float32)
            v = tl.load(vh_ptr + off, mask=ok[:, None], other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scaling
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            lsum = lsum * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m = m_new
        # INT4 stream
        ng = D // QG
        half = D // 2
        kbal_m = tl.load(kbal_ptr + h * 2 * D + d)  # per-channel key balance (mid-range, sqrt range)
        kbal_s = tl.load(kbal_ptr + h * 2 * D + D + d)
        for start in range(0, n_l, BLOCK_N):
            t = start + tl.arange(0, BLOCK_N)
            ok = t < n_l
            blk = t // 64
            i = t % 64
            col = i % 32
            shift = (i >= 32).to(tl.int32) * 4
            kbyte = tl.load(
                kq_ptr + h * (cap_l * half) + blk[:, None] * (D * 32) + d[None, :] * 32 + col[:, None],
                mask=ok[:, None],
                other=0,
            ).to(tl.int32)
            kcode = ((kbyte >> shift[:, None]) & 15).to(tl.float32)
            zoff = h * (ng * cap_l * 2) + (d[None, :] // QG) * (cap_l * 2) + t[:, None] * 2
            kscale = tl.load(ksz_ptr + zoff, mask=ok[:, None], other=0.0).to(tl.float32)
            kzero = tl.load(ksz_ptr + zoff + 1, mask=ok[:, None], other=0.0).to(tl.float32)
            k = ((kcode - 8.0) * kscale + kzero) * kbal_s[None, :] + kbal_m[None, :]
            w = d[None, :] % QG  # index inside the value group; codes stored as adjacent pairs
            vbyte = tl.load(
                vq_ptr
                + h * (cap_l * half)
                + (d[None, :] // QG) * (cap_l * (QG // 2))
                + t[:, None] * (QG // 2)
                + w // 2,
                mask=ok[:, None],
                other=0,
            ).to(tl.int32)
            vcode = ((vbyte >> ((w % 2) * 4)) & 15).to(tl.float32)
            voff = h * (ng * cap_l) + (d[None, :] // QG) * cap_l + t[:, None]
            vscale = tl.load(vs_ptr + voff, mask=ok[:, None], other=0.0).to(tl.float32)
            vzero = tl.load(vz_ptr + voff, mask=ok[:, None], other=0.0).to(tl.float32)
            v = vcode * vscale + vzero
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scaling
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            lsum = lsum * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m = m_new
        out = acc / lsum[:, None]
        tl.store(out_ptr + (h * GRP + rows)[:, None] * D + d[None, :], out, mask=row_ok[:, None])


def triton_decode_attention(q: torch.Tensor, store, scaling: float, block_n: int = 32) -> torch.Tensor:
    """One query token ``q [Hq, 1, D]`` over a sequence store's H and INT4 tiers -> ``[1, Hq, D]``."""
    if triton is None:
        raise PaskError("triton is not installed: pip install triton")
    if q.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise PaskError("the Triton decode kernel needs a GPU, or TRITON_INTERPRET=1 set before importing triton")
    hq, _, d = q.shape
    hkv = store.h.heads
    grp = hq // hkv
    if store.l2.n:
        raise PaskError("the Triton decode kernel reads the H and INT4 tiers, not INT2 tokens")
    if store.h.n + store.l.n == 0:
        raise PaskError("the sequence holds no K/V")
    dev, dt = q.device, store.h.parts["k"].dtype
    empty_h = torch.zeros(hkv, 1, d, dtype=dt, device=dev)
    kh = store.h.t["k"] if store.h.n else empty_h
    vh = store.h.t["v"] if store.h.n else empty_h
    if store.l.n:
        lt, cap_l, kbal = store.l.t, store.l.cap, store.kbal
    else:  # dummy INT4 tier of one block, never read (n_l = 0)
        from pask.kv.storage import _SeqStore

        dummy = _SeqStore(hkv, d, dt, dev, store.l.cfg, store.l.stats)
        dummy.l._realloc(64)
        lt, cap_l = dummy.l.t, 64
        kbal = torch.zeros(hkv, 2, d, device=dev)
    out = torch.empty(hq, d, dtype=torch.float32, device=dev)
    _decode_kernel[(hkv,)](
        q.reshape(hq, d).float().contiguous(),
        out,
        kh,
        vh,
        lt["kq"],
        lt["ksz"],
        kbal.float().contiguous(),
        lt["vq"],
        lt["vs"],
        lt["vz"],
        store.h.n,
        store.l.n,
        kh.stride(0),
        cap_l,
        float(scaling),
        GRP=grp,
        GRP_P=triton.next_power_of_2(grp),
        D=d,
        QG=store.group,
        BLOCK_N=block_n,
    )
    return out.reshape(1, hq, d).to(q.dtype)
