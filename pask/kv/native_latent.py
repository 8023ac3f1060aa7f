"""Native key scores of BellowsKV's latent tokens: bias, RoPE and the query product in one pass.

A latent cache (:mod:`pask.kv.latent`) rebuilds each layer's keys of its latent tokens at every
decode step: one GEMM (latents x the layer's key projection, all rows of the batch at once), then
the bias, the rotation at each token's position and the scores against the query rows. In PyTorch
the last three are four full-size fp32 temporaries per layer, more than the GEMM's time at 8k
tokens x batch 8 (``benchmarks/bellows_layer.py``). ``native_latent.cpp`` does them in one pass over the
GEMM's output, 16 tokens at a time (sequences in parallel over OpenMP threads), and writes the
scores ``[Hkv, rows, m]`` that :func:`pask.kv.attention.latent_attention` takes.

Build and failure handling as for :mod:`pask.kv.native_attention` (:mod:`pask.cpu.native`): built on
first use, probed once against :func:`reference` on random inputs; ``PASK_NATIVE=0`` turns it off
(the PyTorch path runs), a kernel that cannot be built or disagrees raises
:class:`~pask.cpu.native.NativeKernelError` unless ``PASK_ALLOW_FALLBACK=1``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path

import torch

from pask.cpu import native
from pask.kv.latent import rotate_half

SOURCE = Path(__file__).parents[1] / "cpu" / "native_latent.cpp"
FLAGS = [*native.COMMON_FLAGS, "-mprefer-vector-width=512", "-ffp-contract=off"]
MAX_DIM = 256

_LIB: ctypes.CDLL | None = None


def _load() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(native.build(SOURCE, FLAGS)))
    f = lib.pask_latent_scores
    vp, i32 = ctypes.c_void_p, ctypes.c_int
    i64 = ctypes.c_int64
    # m, hkv, rows, d, keys, keys_bf16, bias, cos, sin, cs_stride, nseq, starts, q, scale, out, threads
    f.argtypes = [i64, i32, i32, i32, vp, i32, vp, vp, vp, i64, i32, vp, vp, ctypes.c_float, vp, i32]
    f.restype = ctypes.c_int
    return lib


def reference(
    keys: torch.Tensor,
    bias: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    starts: Sequence[int],
    q: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """What the kernel computes, in PyTorch: ``keys [m, Hkv*D]`` (pre-RoPE, no bias), ``bias [Hkv*D]``,
    ``cos, sin [m, D]`` (the model's RoPE; halves equal), sequence ``starts`` (``nseq + 1``), queries
    ``q [nseq, Hkv, rows, D]`` (fp32) -> scores ``[Hkv, rows, m]`` (fp32)."""
    nseq, hkv, rows, d = q.shape
    k = (keys.float() + bias.float()).view(-1, hkv, d).transpose(0, 1)  # [Hkv, m, D]
    k = k * cos.float() + rotate_half(k) * sin.float()
    out = torch.zeros(hkv, rows, keys.shape[0])
    for b in range(nseq):
        a, e = starts[b], starts[b + 1]
        out[:, :, a:e] = torch.matmul(q[b].float(), k[:, a:e].transpose(1, 2)) * scale
    return out


def _probe() -> str:
    """Build, load and compare with :func:`reference` on random inputs (bf16 and fp32 keys)."""
    global _LIB
    lib, why = native.try_load(_load)
    if why:
        return why
    _LIB = lib
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    for dtype in (torch.bfloat16, torch.float32):
        m, hkv, rows, d = 45, 2, 7, 64
        keys = torch.randn(m, hkv * d, generator=gen).to(dtype)
        bias = torch.randn(hkv * d, generator=gen)
        ang = torch.rand(m, d // 2, generator=gen) * 6.0
        cos, sin = torch.cat([ang.cos()] * 2, dim=1), torch.cat([ang.sin()] * 2, dim=1)
        q = torch.randn(3, hkv, rows, d, generator=gen)
        starts = [0, 20, 20, 45]
        want = reference(keys, bias, cos, sin, starts, q, 0.125)
        got = _call(keys, bias, cos, sin, starts, q, 0.125)
        worst = max(worst, float((got - want).abs().max()))
    if worst > 1e-3:
        _LIB = None
        return f"probe mismatch (max abs error {worst:.5f})"
    return "ok"


_PROBE = native.Probe("native latent scores", "the PyTorch path", _probe)
available = _PROBE.available  # built, loaded and probed (raises unless PASK_ALLOW_FALLBACK=1)
status = _PROBE.status  # "ok" or why not (never raises)


def applies(keys: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether :func:`scores` serves these keys and queries (CPU, bf16 / fp32, head size <= 256, even)."""
    d = q.shape[-1]
    return (
        keys.device.type == "cpu"
        and keys.dtype in (torch.bfloat16, torch.float32)
        and d % 2 == 0
        and d <= MAX_DIM
        and available()
    )


def _call(keys, bias, cos, sin, starts, q, scale) -> torch.Tensor:
    nseq, hkv, rows, d = q.shape
    m = keys.shape[0]
    half = d // 2
    keys = keys.contiguous()  # cos / sin: their first halves read in place (row stride) when fp32
    bias = bias.float().contiguous()
    if cos.dtype != torch.float32 or sin.dtype != torch.float32 or cos.stride() != sin.stride() or cos.stride(1) != 1:
        cos, sin = cos[:, :half].float().contiguous(), sin[:, :half].float().contiguous()
    qf = q.float().contiguous()
    out = torch.empty(hkv, rows, m)
    st = (ctypes.c_int64 * (nseq + 1))(*starts)
    rc = _LIB.pask_latent_scores(m, hkv, rows, d, keys.data_ptr(), int(keys.dtype == torch.bfloat16),
                                 bias.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos.stride(0), nseq, st,
                                 qf.data_ptr(), float(scale), out.data_ptr(), torch.get_num_threads())  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"native latent scores rejected the shape (Hkv {hkv}, rows {rows}, D {d}, m {m})")
    return out


def scores(
    keys: torch.Tensor,
    bias: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    starts: Sequence[int],
    q: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The kernel on the arguments of :func:`reference` (``cos`` / ``sin`` halves equal: the HF RoPE layout)."""
    if _LIB is None and not available():
        raise RuntimeError(f"pask native latent scores are {status()}")
    return _call(keys, bias, cos, sin, starts, q, scale)
