"""Native BF16-weight linear for decode steps (a few input rows).

``native_gemv.cpp`` computes ``x W^T + b`` reading the bf16 weight in place, widening it to fp32
exactly and accumulating in fp32: the fp32 product of the ``fp32`` / ``fp32-weights`` modes of
:mod:`pask.cpu.bf16_matmul` up to summation order, at half the bytes of an fp32 weight copy and without
PyTorch's slow bf16 GEMV. Built by :mod:`pask.cpu.native` on first use; a start-up probe compares it
with ``F.linear`` in fp32 on random shapes. With ``PASK_NATIVE=0`` :func:`available` is False and
callers keep their PyTorch path. Without a compiler, without the source (a broken install), or if
the probe fails, :func:`available` raises :class:`pask.cpu.native.NativeKernelError`;
``PASK_ALLOW_FALLBACK=1`` makes it warn and return False instead (:func:`pask.cpu.native.unavailable`).
:func:`status` reports the state without raising.

On CPUs with AVX512-BF16, :func:`linear_bf16` takes bf16 in and out (what a bf16 GEMM computes:
exact products, fp32 sums, one rounding) for :func:`pask.cpu.bf16_matmul.apply_gemv`: AMX tiles where
the CPU and OS allow (``A`` = 16 weight rows read in place, ``B`` = the input's transpose as bf16
pairs packed once per call; :func:`use_amx`, ``PASK_AMX=0``), else dot products over two weight
rows and up to 8 input rows at a time.
"""

from __future__ import annotations

import ctypes
import itertools
from pathlib import Path

import torch
import torch.nn.functional as F

from pask.cpu import native

SOURCE = Path(__file__).with_name("native_gemv.cpp")
FLAGS = list(native.COMMON_FLAGS)
MAX_ROWS = 16  # input rows up to which :func:`applies` (decode batches); larger inputs are GEMMs

_LIB: ctypes.CDLL | None = None


def _probe() -> str:
    global _LIB
    lib, why = native.try_load(lambda: ctypes.CDLL(str(native.build(SOURCE, FLAGS))))
    if why:
        return why
    f = lib.pask_linear_bf16
    f.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 4 + [ctypes.c_int]
    f.restype = ctypes.c_int
    lib.pask_gemv_isa.restype = ctypes.c_char_p
    g = lib.pask_linear_bf16_io
    g.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 4 + [ctypes.c_int]
    g.restype = ctypes.c_int
    lib.pask_gemv_use_amx.argtypes = [ctypes.c_int]
    lib.pask_gemv_use_amx.restype = ctypes.c_int
    for name in ("pask_linear_q", "pask_linear_q_io"):
        h = getattr(lib, name)
        h.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 5 + [ctypes.c_int] * 2
        h.restype = ctypes.c_int
    lib.pask_dequant_q.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 3 + [ctypes.c_int] * 2
    lib.pask_dequant_q.restype = ctypes.c_int
    lib.pask_q_kernel.restype = ctypes.c_char_p
    lib.pask_q_use_int8.argtypes = [ctypes.c_int]
    lib.pask_q_use_int8.restype = ctypes.c_int
    _LIB = lib
    gen = torch.Generator().manual_seed(0)
    for m, k, n, bias in ((1, 64, 40, False), (3, 136, 17, True), (8, 256, 33, True), (11, 64, 5, False)):
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
        b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
        want = F.linear(x.float(), w.float(), None if b is None else b.float())
        got = _call(x, w, b)
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
            _LIB = None
            return f"probe mismatch (max abs error {float((got - want).abs().max()):.2e})"
    if lib.pask_gemv_has_bf16_io():  # bf16 in / out: one rounding of the fp32 sum (AMX tiles, dot products)
        for m, k, n, bias in ((1, 64, 40, False), (8, 896, 48, True), (16, 96, 33, True), (5, 40, 17, False)):
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
            b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
            want = F.linear(x.float(), w.float(), None if b is None else b.float())
            got = linear_bf16(x, w, b).float()
            if not torch.allclose(got, want, rtol=2**-7, atol=1e-3):
                _LIB = None
                return f"probe mismatch, bf16 path (max abs error {float((got - want).abs().max()):.2e})"
    # INT4 / INT8 weights (any bytes are codes of the tiled layout): within int8 activations' error of F.linear
    for (m, k, n), bits in itertools.product(((1, 64, 40), (9, 96, 17)), (4, 8)):
        nb = -(-n // 16)
        codes = torch.randint(0, 256, (nb, k // 32, bits, 64), dtype=torch.uint8, generator=gen)
        sz = ((torch.rand(nb, k // 32, 2, 16, generator=gen) - 0.5) * 0.1).to(torch.bfloat16)
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        want = F.linear(x.float(), dequant(codes, sz, n, bits).float())
        got = linear_quant(x, codes, sz, n, bits).float()
        if not torch.allclose(got, want, rtol=0.05, atol=0.05 * float(want.abs().max())):
            _LIB = None
            return f"probe mismatch, int{bits} path (max abs error {float((got - want).abs().max()):.2e})"
    return "ok"


_PROBE = native.Probe("native gemv", "PyTorch's linear", _probe)
available = _PROBE.available  # whether the kernel is built, loaded and probed (raises unless PASK_ALLOW_FALLBACK=1)
status = _PROBE.status  # "ok" or why the kernel is not used (never raises)


def isa() -> str | None:
    """The instruction set the kernel runs (``avx512bf16+amx``, ``avx512bf16``, ``avx2``, ``portable``), or None."""
    return _LIB.pask_gemv_isa().decode() if status() == "ok" and _LIB is not None else None


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`linear` serves this bf16 input and weight on the CPU (at most ``MAX_ROWS`` rows)."""
    return (
        x.device.type == "cpu"
        and weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and x.shape[-1] == weight.shape[1]
        and weight.shape[1] % 8 == 0
        and 0 < x.numel() <= MAX_ROWS * x.shape[-1]
        and weight.is_contiguous()
        and available()
    )


def _call(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    k, n = weight.shape[1], weight.shape[0]
    x32 = x.reshape(-1, k).float().contiguous()
    b32 = None if bias is None else bias.float().contiguous()
    y = torch.empty(x32.shape[0], n, dtype=torch.float32)
    rc = _LIB.pask_linear_bf16(
        x32.shape[0],
        k,
        n,
        x32.data_ptr(),
        weight.data_ptr(),
        None if b32 is None else b32.data_ptr(),
        y.data_ptr(),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"native gemv rejected the shape ({x32.shape[0]} x {k} x {n})")
    return y.reshape(*x.shape[:-1], n)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x.float(), weight.float(), bias.float())`` in fp32 (shape ``[..., N]``), reading
    the bf16 ``weight [N, K]`` in place; callers check :func:`applies` first."""
    if _LIB is None and not available():
        raise RuntimeError(f"pask native gemv is {status()}")
    return _call(x, weight, bias)


def has_bf16_io() -> bool:
    """Whether :func:`linear_bf16` runs here (the kernel built with AVX512-BF16 dot products)."""
    return available() and _LIB is not None and bool(_LIB.pask_gemv_has_bf16_io())


def linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` on bf16 ``x [..., K]``, ``weight [N, K]``, ``bias [N]`` -> bf16 ``[..., N]`` with
    AVX512-BF16 dot products: exact products, fp32 sums, one rounding (what a bf16 GEMM computes, up
    to summation order). Callers check :func:`applies` and :func:`has_bf16_io` first."""
    k, n = weight.shape[1], weight.shape[0]
    xb = x.reshape(-1, k).contiguous()
    b = None if bias is None else bias.to(torch.bfloat16).contiguous()
    y = torch.empty(xb.shape[0], n, dtype=torch.bfloat16)
    rc = _LIB.pask_linear_bf16_io(
        xb.shape[0], k, n, xb.data_ptr(), weight.data_ptr(), None if b is None else b.data_ptr(), y.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"native bf16 gemv rejected the shape ({xb.shape[0]} x {k} x {n})")
    return y.reshape(*x.shape[:-1], n)


def use_amx(on: bool) -> bool:
    """Turn the AMX tiles of :func:`linear_bf16` on or off (on by default where the CPU and OS allow;
    ``PASK_AMX=0`` starts with them off); returns whether they are on now."""
    return has_bf16_io() and bool(_LIB.pask_gemv_use_amx(int(on)))


def dequant(codes: torch.Tensor, sz: torch.Tensor, n: int, bits: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 weight ``[n, K]`` of a tiled INT4 / INT8 weight (:func:`pask.cpu.weights.quantize`):
    ``fma(code, scale, zero)`` rounded to nearest even (into ``out``, a contiguous bf16 ``[n, K]``, if given)."""
    if _LIB is None and not available():
        raise RuntimeError(f"pask native gemv is {status()}")
    k = codes.shape[1] * 32
    if out is None:
        out = torch.empty(n, k, dtype=torch.bfloat16)
    elif out.shape != (n, k) or out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise RuntimeError(f"dequant: out must be a contiguous bf16 [{n}, {k}] tensor")
    rc = _LIB.pask_dequant_q(k, 0, n, codes.data_ptr(), sz.data_ptr(), out.data_ptr(), bits, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"native dequantisation rejected the shape ({n} x {k}, {bits} bits)")
    return out


def quant_amx() -> bool:
    """Whether :func:`linear_quant` runs decode rows on AMX-INT8 tiles here (int8 activations per
    group of 32) rather than the bf16 kernels over dequantised rows."""
    return quant_kernel() == "amx-int8"


def quant_kernel() -> str:
    """The kernel :func:`linear_quant` runs decode rows on here: ``amx-int8`` / ``avx2-int8`` (the
    input quantised to int8 per group of 32, the same arithmetic bit for bit: AMX-INT8 tiles or
    AVX2 ``pmaddubsw``) or ``dequant`` (the bf16 / fp32 kernels over dequantised rows)."""
    return _LIB.pask_q_kernel().decode() if available() and _LIB is not None else "dequant"


def use_int8_linears(on: bool | None) -> bool:
    """Turn the AVX2 integer path of :func:`linear_quant` on or off (on by default; ``PASK_INT8_LINEAR=0``
    starts with it off; None only reads); returns whether it is on. False on builds without it (AMX:
    :func:`use_amx`; AVX512-BF16 without AMX-INT8: dequantised rows)."""
    if not (available() and _LIB is not None):
        return False
    return bool(_LIB.pask_q_use_int8(-1 if on is None else int(on)))


def _quant_call(x: torch.Tensor, codes, sz, n: int, bits: int, bias, dtype: torch.dtype) -> torch.Tensor:
    """The native quantised linear with ``dtype`` in and out: bf16 through ``pask_linear_q_io``, fp32
    through ``pask_linear_q``; ``[..., n]``."""
    k = codes.shape[1] * 32
    xb = x.reshape(-1, k).to(dtype).contiguous()
    b = None if bias is None else bias.to(dtype).contiguous()
    y = torch.empty(xb.shape[0], n, dtype=dtype)
    fn = _LIB.pask_linear_q_io if dtype == torch.bfloat16 else _LIB.pask_linear_q
    rc = fn(
        xb.shape[0], k, n, xb.data_ptr(), codes.data_ptr(), sz.data_ptr(), None if b is None else b.data_ptr(),
        y.data_ptr(), bits, torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"native quantised linear rejected the shape ({xb.shape[0]} x {k} x {n}, {bits} bits)")
    return y.reshape(*x.shape[:-1], n)


def linear_quant_f32(
    x: torch.Tensor, codes: torch.Tensor, sz: torch.Tensor, n: int, bits: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`linear_quant` before its output's rounding to bf16 (fp32 ``[..., n]``), on builds
    without :func:`has_bf16_io` (where the kernel's output is fp32): for exactness tests."""
    if _LIB is None and not available():
        raise RuntimeError(f"pask native gemv is {status()}")
    if _LIB.pask_gemv_has_bf16_io():
        raise RuntimeError("linear_quant_f32: this build's quantised kernels return bf16")
    return _quant_call(x, codes, sz, n, bits, bias, torch.float32)


def linear_quant(
    x: torch.Tensor, codes: torch.Tensor, sz: torch.Tensor, n: int, bits: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear`` on bf16 ``x [..., K]`` over a tiled INT4 / INT8 weight of ``n`` outputs -> bf16
    ``[..., n]``: decode rows with int8 activations on AMX-INT8 tiles or AVX2 (:func:`quant_kernel`),
    else :func:`linear_bf16`'s arithmetic where :func:`has_bf16_io`, else :func:`linear`'s fp32 one
    rounded to bf16, over :func:`dequant`'s weight."""
    if _LIB is None and not available():
        raise RuntimeError(f"pask native gemv is {status()}")
    rows = x.numel() // codes.shape[1] // 32
    bf16_io = _LIB.pask_gemv_has_bf16_io() or (rows <= MAX_ROWS and _LIB.pask_q_use_int8(-1))
    y = _quant_call(x, codes, sz, n, bits, bias, torch.bfloat16 if bf16_io else torch.float32)
    return y.to(torch.bfloat16)
