"""Native RMSNorm for bf16 decode steps, bit-identical to the model's own.

A decode step calls RMSNorm 2L + 1 times (49 for qwen2.5-coder-0.5b) on a few rows each, and
PyTorch spends ~40-100 us per call on its seven small ops, several ms per step. ``native_norm.cpp``
does the whole norm in one call and returns the same bits as transformers' Qwen2 / Llama RMSNorm
(fp32 sum of squares in PyTorch's own summation order, ``rsqrt``, two bf16 roundings), so outputs,
accuracy cells and prefill stores do not change. A start-up probe compares it with the PyTorch
formula bit for bit on random rows and finds the vector width of PyTorch's sum kernel (8 or 16
lanes); if neither matches (another PyTorch), :func:`available` raises
:class:`pask.cpu.native.NativeKernelError` (``PASK_ALLOW_FALLBACK=1``: a warning and PyTorch's norm).
``PASK_NATIVE=0`` keeps PyTorch's norm silently, as does ``PASK_NATIVE_NORM=0`` alone (for
timing the two side by side; the outputs are the same bits).

:func:`apply` swaps a bf16 model's RMSNorm modules (the classes in :data:`SAME_FORMULA`) for
:class:`NativeRMSNorm`, which runs the native norm on contiguous bf16 rows and the PyTorch formula
on anything else (fp32 models, other layouts).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from pask.cpu import native

SOURCE = Path(__file__).with_name("native_norm.cpp")
FLAGS = [*native.COMMON_FLAGS, "-ffp-contract=off"]  # no fused multiply-adds: PyTorch rounds each product
SAME_FORMULA = ("Qwen2RMSNorm", "LlamaRMSNorm")  # transformers classes whose forward is :func:`reference`

ENV = "PASK_NATIVE_NORM"  # "0": keep PyTorch's norms (timing A/B; the same bits either way)

_LIB: ctypes.CDLL | None = None
_VEC = 0  # lanes of PyTorch's float sum kernel, found by the probe


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen2RMSNorm / LlamaRMSNorm forward, op for op."""
    dtype = x.dtype
    h = x.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(var + eps)
    return weight * h.to(dtype)


def _call(x: torch.Tensor, weight: torch.Tensor, eps: float, vec: int) -> torch.Tensor:
    out = torch.empty_like(x)
    n = x.shape[-1]
    rc = _LIB.pask_rms_norm_bf16(x.numel() // n, n, x.data_ptr(), weight.data_ptr(), eps, vec, out.data_ptr())
    if rc != 0:
        raise RuntimeError(f"pask_rms_norm_bf16 returned {rc}")
    return out


def _probe() -> str:
    global _LIB, _VEC
    lib, why = native.try_load(lambda: ctypes.CDLL(str(native.build(SOURCE, FLAGS))))
    if why:
        return why
    f = lib.pask_rms_norm_bf16
    f.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float, ctypes.c_int]
    f.argtypes += [ctypes.c_void_p]
    f.restype = ctypes.c_int
    _LIB = lib
    gen = torch.Generator().manual_seed(0)
    cases = []
    for rows, n in ((1, 896), (8, 896), (3, 64), (2, 100), (5, 1536), (1, 17), (2, 8960), (16, 576)):
        x = (torch.randn(rows, n, generator=gen) * torch.rand(rows, 1, generator=gen) * 8).to(torch.bfloat16)
        w = (torch.randn(n, generator=gen) * 0.5 + 1).to(torch.bfloat16)
        cases.append((x, w, reference(x, w, 1e-6)))
    for vec in (8, 16):
        if all(torch.equal(_call(x, w, 1e-6, vec), want) for x, w, want in cases):
            _VEC = vec
            return "ok"
    _LIB = None
    return "probe mismatch: no summation order reproduces PyTorch's RMSNorm bit for bit"


_PROBE = native.Probe("RMSNorm", "PyTorch's RMSNorm", _probe)
status = _PROBE.status
available = _PROBE.available


def enabled() -> bool:
    """Whether ``PASK_NATIVE_NORM`` leaves :func:`apply` on (the default)."""
    return os.environ.get(ENV, "1") != "0"


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the native norm serves this call: contiguous bf16 rows on the CPU, a bf16 weight of
    the row length (anything else runs :func:`reference`)."""
    return (
        x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and x.is_contiguous()
        and weight.is_contiguous()
        and x.dim() >= 1
        and x.shape[-1] == weight.numel()
        and x.numel() > 0
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x``'s rows times ``weight``: the native kernel where it applies (and is
    available), else :func:`reference`; the same bits either way."""
    if applies(x, weight) and available():
        return _call(x, weight, eps, _VEC)
    return reference(x, weight, eps)


class NativeRMSNorm(torch.nn.Module):
    """Drop-in for a transformers RMSNorm of :data:`SAME_FORMULA`: the same ``weight`` parameter and
    ``variance_epsilon``, forward by :func:`rms_norm`."""

    def __init__(self, weight: torch.nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight = weight
        self.variance_epsilon = eps

    @classmethod
    def from_module(cls, module: torch.nn.Module) -> NativeRMSNorm:
        return cls(module.weight, float(module.variance_epsilon))

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def apply(model: torch.nn.Module) -> int:
    """Swap ``model``'s RMSNorm modules of :data:`SAME_FORMULA` with bf16 weights on the CPU for
    :class:`NativeRMSNorm`; returns how many. Nothing with ``PASK_NATIVE=0``, for other dtypes or
    devices; raises :class:`~pask.cpu.native.NativeKernelError` when the kernel is wanted but fails
    its probe (``PASK_ALLOW_FALLBACK=1``: warns and swaps nothing). ``PASK_NATIVE_NORM=0``: nothing."""
    found = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child).__name__ in SAME_FORMULA
        and getattr(child, "weight", None) is not None
        and child.weight.dtype == torch.bfloat16
        and child.weight.device.type == "cpu"
    ]
    if not found or native.disabled() or not enabled() or not available():
        return 0
    for parent, name, child in found:
        setattr(parent, name, NativeRMSNorm.from_module(child))
    return len(found)
