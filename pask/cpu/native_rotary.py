"""Native rotary position embedding for bf16 decode steps, bit-identical to transformers' own.

A decode step applies the rotary embedding once per layer (24 times for qwen2.5-coder-0.5b) to a
few query and key rows, and PyTorch spends its time on the ten small ops of
``apply_rotary_pos_emb`` (two ``rotate_half`` s, four products, two sums): ~4-5 ms of a c = 8 step
on the AVX2 EPYC (``benchmarks/serve_breakdown.py``). ``native_rotary.cpp`` does both tensors in
one call with the same three roundings per value as PyTorch's bf16 ops (products of bf16 values are
exact in fp32 and rounded once; the sum is an fp32 addition rounded once), so outputs, accuracy
cells and prefill stores do not change. A start-up probe compares it with transformers' function bit
for bit (transposed views, shared and per-row ``cos``); on a mismatch :func:`available` raises
:class:`pask.cpu.native.NativeKernelError` (``PASK_ALLOW_FALLBACK=1``: a warning and PyTorch's op).
``PASK_NATIVE=0`` keeps PyTorch's op silently, as does ``PASK_NATIVE_ROTARY=0`` alone (for timing
the two side by side; the same bits either way).

:func:`install` replaces ``apply_rotary_pos_emb`` in transformers' Qwen2 and Llama modeling modules
(whose attention looks it up there at each call) with :func:`rotary`, which runs the native op on
bf16 CPU tensors of the decode layout and the original function on anything else.
"""

from __future__ import annotations

import ctypes
import importlib
import os
from collections.abc import Callable
from pathlib import Path

import torch

from pask.cpu import native

SOURCE = Path(__file__).with_name("native_rotary.cpp")
FLAGS = [*native.COMMON_FLAGS, "-ffp-contract=off"]  # no fused multiply-adds: PyTorch rounds each product
MODULES = ("transformers.models.qwen2.modeling_qwen2", "transformers.models.llama.modeling_llama")
ENV = "PASK_NATIVE_ROTARY"  # "0": keep PyTorch's op (timing A/B; the same bits either way)

_LIB: ctypes.CDLL | None = None
_ORIGINAL: dict[str, Callable] = {}  # module name -> the function install() replaced there


def reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1):
    """transformers' ``apply_rotary_pos_emb``, op for op."""

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        return torch.cat((-x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]), dim=-1)

    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def applies(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1) -> bool:
    """Whether the native op serves this call: bf16 CPU ``q [B, Hq, S, D]``, ``k [B, Hk, S, D]``
    (the last dimension contiguous), contiguous ``cos`` / ``sin [B or 1, S, D]``, ``unsqueeze_dim``
    1, an even D."""
    bf = torch.bfloat16
    if not (q.dtype is bf and k.dtype is bf and cos.dtype is bf and sin.dtype is bf and unsqueeze_dim == 1):
        return False
    if not (q.is_cpu and k.is_cpu and cos.is_cpu and sin.is_cpu and q.dim() == 4 and k.dim() == 4 and cos.dim() == 3):
        return False
    b, _, s, d = q.shape
    kb, _, ks, kd = k.shape
    cb, cs, cd = cos.shape
    return (
        kb == b
        and ks == cs == s
        and kd == cd == d
        and d % 2 == 0
        and (cb == 1 or cb == b)
        and sin.shape == cos.shape
        and q.stride(-1) == 1
        and k.stride(-1) == 1
        and cos.is_contiguous()
        and sin.is_contiguous()
        and q.numel() > 0
        and k.numel() > 0
    )


def _call(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    qo, ko = torch.empty(q.shape, dtype=q.dtype), torch.empty(k.shape, dtype=k.dtype)
    qs, ks = (ctypes.c_int64 * 4)(*q.stride()), (ctypes.c_int64 * 4)(*k.stride())
    b, hq, s, d = q.shape
    rc = _LIB.pask_rotary_bf16(
        b, hq, k.shape[1], s, d, q.data_ptr(), qs, k.data_ptr(), ks, cos.data_ptr(), sin.data_ptr(), cos.shape[0],
        qo.data_ptr(), ko.data_ptr(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"pask_rotary_bf16 returned {rc}")
    return qo, ko


def _probe() -> str:
    global _LIB
    lib, why = native.try_load(lambda: ctypes.CDLL(str(native.build(SOURCE, FLAGS))))
    if why:
        return why
    f = lib.pask_rotary_bf16
    f.argtypes = [ctypes.c_int64] * 5 + [ctypes.c_void_p] * 6 + [ctypes.c_int64] + [ctypes.c_void_p] * 2
    f.restype = ctypes.c_int
    _LIB = lib
    gen = torch.Generator().manual_seed(0)
    for b, hq, hk, s, d, cb in ((1, 14, 2, 1, 64, 1), (8, 14, 2, 1, 64, 8), (2, 4, 4, 7, 128, 1), (3, 6, 2, 5, 32, 3)):
        q = (torch.randn(b, s, hq, d, generator=gen) * 4).to(torch.bfloat16).transpose(1, 2)  # the model's views
        k = (torch.randn(b, s, hk, d, generator=gen) * 40).to(torch.bfloat16).transpose(1, 2)
        ang = torch.rand(cb, s, d, generator=gen) * 100
        cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
        want, got = reference(q, k, cos, sin), _call(q, k, cos, sin)
        if not all(torch.equal(w, g) for w, g in zip(want, got, strict=True)):
            _LIB = None
            return "probe mismatch: the native rotary embedding differs from PyTorch's bit for bit"
    return "ok"


_PROBE = native.Probe("rotary", "PyTorch's rotary embedding", _probe)
status = _PROBE.status
available = _PROBE.available


def enabled() -> bool:
    """Whether ``PASK_NATIVE_ROTARY`` leaves :func:`install` on (the default)."""
    return os.environ.get(ENV, "1") != "0"


def _rotary_for(original: Callable) -> Callable:
    def rotary(q, k, cos, sin, unsqueeze_dim=1):
        """``apply_rotary_pos_emb``: the native op where it applies, else the replaced function (the same bits)."""
        if applies(q, k, cos, sin, unsqueeze_dim) and _LIB is not None:
            return _call(q, k, cos, sin)
        return original(q, k, cos, sin, unsqueeze_dim)

    rotary.pask_native_rotary = True
    return rotary


def install() -> int:
    """Replace ``apply_rotary_pos_emb`` in the modules of :data:`MODULES` (once per process each);
    returns how many are replaced now, earlier installs included. Nothing with ``PASK_NATIVE=0`` or
    ``PASK_NATIVE_ROTARY=0``; raises :class:`~pask.cpu.native.NativeKernelError` when the kernel is
    wanted but fails its probe (``PASK_ALLOW_FALLBACK=1``: warns and replaces nothing)."""
    if native.disabled() or not enabled() or not available():
        return len(_ORIGINAL)
    for name in MODULES:
        if name in _ORIGINAL:
            continue
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        fn = getattr(mod, "apply_rotary_pos_emb", None)
        if fn is None:
            continue
        _ORIGINAL[name] = fn
        mod.apply_rotary_pos_emb = _rotary_for(fn)
    return len(_ORIGINAL)


def uninstall() -> None:
    """Give the modules back the functions :func:`install` replaced (tests)."""
    for name, fn in _ORIGINAL.items():
        importlib.import_module(name).apply_rotary_pos_emb = fn
    _ORIGINAL.clear()
