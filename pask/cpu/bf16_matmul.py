"""BF16 linear layers on CPUs without BF16 arithmetic: the same bf16 values, multiplied in fp32.

On an x86 CPU without AVX512-BF16 or AMX (e.g. AMD Zen 3, Intel before Cooper Lake), PyTorch's
bf16 GEMM has no native instructions to use: measured on a 2-core AMD EPYC (AVX2), a
``[512, 896] x [896, 4864]`` bf16 linear takes 653 ms against 105 ms in fp32, and a 512-token
prefill of qwen2.5-coder-0.5b 27.8 s against 4.3 s. :func:`apply` makes every ``nn.Linear`` of a
bf16 model compute ``linear(x.float(), w.float()).to(bf16)`` when the input has at least
``MIN_ROWS`` rows (prefill, extends): inputs, weights and outputs stay bf16, so the model, its KV
cache and every budget are unchanged; only the products are formed in fp32 (which a bf16 GEMM
also accumulates in), at the price of upcasting the weight per call. Decode steps (a few rows)
keep the native bf16 GEMV, which is cheaper than upcasting the weight there.

``PASK_BF16_MATMUL`` selects the mode: ``auto`` (default: fp32 compute where the CPU lacks BF16
instructions, ``gemv`` where it has them), ``fp32`` (always), ``native`` (PyTorch's bf16 kernels for
every input, decode steps included: not batch-invariant, see below), ``gemv`` or ``fp32-weights``: every bf16 linear
also keeps an fp32 copy of its weight (3x the weight memory: bf16 + fp32) and uses it for every
input, decode steps included (faster decode GEMVs where bf16 ones are slow: on the AVX2 machine a
batch-16 decode step of qwen2.5-coder-0.5b takes 644 ms against 1044 ms native, batch 8 458 vs
541 ms; ``benchmarks/results/bf16_matmul.md``). Outputs stay bf16 in every mode.

In every mode but ``native``, inputs of at most :data:`pask.cpu.native_gemv.MAX_ROWS` rows (decode
steps) go to the native bf16-weight kernel of :mod:`pask.cpu.native_gemv` where it is available: the
same fp32 product (up to summation order) reading the bf16 weight in place, several times faster
than both PyTorch GEMVs on that machine because a decode step is bound by reading the weights.
``gemv`` (CPUs with BF16 arithmetic; what ``auto`` means there): PyTorch's bf16 GEMM for prefills
and the native bf16 GEMV for decode-sized inputs (:func:`apply_gemv`; AVX512-BF16 dot products or
AMX tiles, the bf16 GEMM's arithmetic up to summation order).

Batch invariance: both native decode kernels sum each output in an order that does not depend on
the number of input rows, so a row's decode step gives the same bits alone or in a batch of up to
``MAX_ROWS`` (``tests/test_batch_invariance.py``). PyTorch's bf16 GEMM does not: on an AVX512-BF16
CPU a ``[6, 1536] x [1536, 576]`` product gave one row different bits than the same row alone,
enough to change greedy tokens under KIVI-4 (issue 26). Hence ``auto`` takes the native GEMV on
every CPU; ``native`` (PyTorch's kernels, as the cells committed before that change on AVX512-BF16
machines were computed) stays available to reproduce them.
"""

from __future__ import annotations

import os
import types
from pathlib import Path

import torch
import torch.nn.functional as F

from pask.cpu import native_gemv
from pask.errors import PaskError

MIN_ROWS = 32  # rows of input from which the fp32 product is faster than the native bf16 GEMM
MODES = ("auto", "fp32", "fp32-weights", "native", "gemv")
_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_has_bf16(cpuinfo: str | None = None) -> bool:
    """Whether the CPU has BF16 arithmetic (AVX512-BF16 or AMX-BF16 in ``/proc/cpuinfo``).

    Where the flags cannot be read (not Linux, not x86), assume it does and change nothing.
    """
    if cpuinfo is None:
        p = Path("/proc/cpuinfo")
        try:
            cpuinfo = p.read_text()
        except OSError:
            return True
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), None)
    if flags is None:
        return True
    return any(f in flags for f in _BF16_FLAGS)


def mode() -> str:
    """The configured mode (``PASK_BF16_MATMUL``, default ``auto``)."""
    m = os.environ.get("PASK_BF16_MATMUL", "auto").strip().lower() or "auto"
    if m not in MODES:
        raise PaskError(f"PASK_BF16_MATMUL must be one of {', '.join(MODES)}, got {m!r}")
    return m


def _fp32_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The fp32 product on bf16 inputs: decode-sized inputs through the native gemv kernel where
    it applies; else the resident fp32 weight copy where the layer has one (``fp32-weights``), else
    upcasting the weight for inputs of ``MIN_ROWS`` rows or more; other inputs take the native GEMM."""
    if x.dtype == torch.bfloat16 and native_gemv.applies(x, self.weight):
        return native_gemv.linear(x, self.weight, self.bias).to(torch.bfloat16)
    w32 = self._buffers.get("pask_weight_fp32")
    if x.dtype != torch.bfloat16 or (w32 is None and x.numel() < MIN_ROWS * x.shape[-1]):
        return F.linear(x, self.weight, self.bias)
    bias = None if self.bias is None else self.bias.float()
    return F.linear(x.float(), self.weight.float() if w32 is None else w32, bias).to(torch.bfloat16)


def _checked(how: str | None) -> str:
    """``how``, or the configured mode when None; a clear error for an unknown one."""
    how = mode() if how is None else how
    if how not in MODES:
        raise PaskError(f"bf16 matmul mode must be one of {', '.join(MODES)}, got {how!r}")
    return how


#: Row counts per doubling that a bf16 GEMM of :func:`bounded_linear` (and BellowsKV's latent GEMMs) sees.
ROW_BUCKETS = 16


def row_bucket(m: int) -> int:
    """``m`` rounded up to a multiple of ``2 ** (bit_length(m) - 4)`` (at least 16): at most
    :data:`ROW_BUCKETS` counts per doubling, at most 1/8 more rows.

    PyTorch's bf16 GEMM (oneDNN) keeps memory for every new input shape it sees and does not give
    it back: about 0.75 MB per shape on the AVX-512 + AMX machine, 5 MB per distinct prompt length
    over qwen2.5-coder-0.5b's linears. GEMMs over bucketed row counts see a bounded set of shapes."""
    if m <= 0:
        return 0
    step = max(16, 1 << max(m.bit_length() - 4, 0))
    return -(-m // step) * step


def bounded_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` of a bf16 input over :func:`row_bucket` of its rows (zero rows appended, the
    output cut back), so that a server's memory does not grow with every new prompt length (see
    :func:`row_bucket`); at most 1/8 more rows to multiply. Rows are independent: only the GEMM's
    blocking can change a row's bits."""
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    padded = row_bucket(n)
    if padded == n:
        return F.linear(x, weight, bias)
    buf = rows.new_zeros(padded, rows.shape[1])
    buf[:n] = rows
    return F.linear(buf, weight, bias)[:n].view(*x.shape[:-1], weight.shape[0])


def _bf16_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """Decode-sized bf16 inputs through the native bf16 GEMV (:func:`pask.cpu.native_gemv.linear_bf16`:
    a bf16 GEMM's arithmetic, reading the weight once, on AMX tiles where the CPU has them); larger
    ones through PyTorch's GEMM over bucketed row counts (:func:`bounded_linear`)."""
    if x.dtype == torch.bfloat16 and native_gemv.applies(x, self.weight):
        return native_gemv.linear_bf16(x, self.weight, self.bias)
    if x.dtype == torch.bfloat16 and native_gemv.available():
        return bounded_linear(x, self.weight, self.bias)
    return F.linear(x, self.weight, self.bias)


def resolved(how: str | None = None) -> str:
    """The mode that ``how`` (default: the configured mode) means on this CPU: ``auto`` is ``gemv`` on
    a CPU with BF16 arithmetic and ``fp32`` elsewhere."""
    how = _checked(how)
    if how == "auto":
        return "gemv" if cpu_has_bf16() else "fp32"
    return how


def serving_mode() -> str:
    """The mode of the server (``pask serve``, ``pask bench serve``): the configured one, with
    ``auto`` read as ``gemv`` (in the server's decode thread the native bf16 GEMV makes a batch-16
    decode step over 8k tokens of qwen2.5-coder-0.5b faster for every policy:
    ``benchmarks/results/serving/gemv-ab``)."""
    m = mode()
    return "gemv" if m == "auto" else m


def apply_gemv(model: torch.nn.Module, how: str | None = None) -> int:
    """In ``gemv`` mode (``auto`` on a CPU with BF16 arithmetic), route the decode-sized inputs of the
    bf16 ``nn.Linear`` layers to the native bf16 GEMV (AVX512-BF16; AMX tiles where allowed): faster
    than PyTorch's GEMM and batch-invariant. Returns the number of layers changed (0 in other modes,
    on other CPUs or without the kernel).

    On the AVX-512 + AMX machine a batch-8 decode step of qwen2.5-coder-0.5b takes 73.4 ms with it
    against 88.0 ms with PyTorch's GEMM (``benchmarks/results/bf16_matmul.md``).
    """
    how = resolved(how)
    if how != "gemv" or not cpu_has_bf16() or not native_gemv.has_bf16_io():
        return 0
    n = 0
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear) and mod.weight.dtype == torch.bfloat16 and mod.weight.device.type == "cpu":
            mod.forward = types.MethodType(_bf16_forward, mod)
            n += 1
    return n


def apply(model: torch.nn.Module, how: str | None = None) -> int:
    """Give the bf16 ``nn.Linear`` layers of ``model`` fp32 products where the mode asks for it.

    Returns the number of layers changed (0 for a model that is not bf16, on a CPU with BF16
    arithmetic in ``auto`` mode, or in ``native`` mode). Idempotent.
    """
    how = _checked(how)
    if how in ("native", "gemv") or (how == "auto" and cpu_has_bf16()):
        return 0
    n = 0
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear) and mod.weight.dtype == torch.bfloat16 and mod.weight.device.type == "cpu":
            if how == "fp32-weights" and "pask_weight_fp32" not in mod._buffers:
                mod.register_buffer("pask_weight_fp32", mod.weight.detach().float(), persistent=False)
            mod.forward = types.MethodType(_fp32_forward, mod)
            n += 1
    return n
