"""Weight formats of a loaded model: ``bf16`` (the GGUF dequantised once, as converted), ``int8``, ``int4``.

``int8`` / ``int4`` are weight-only quantisation of every ``nn.Linear`` whose input width is a
multiple of 32 (the decoder layers' projections and the LM head; the token embedding stays bf16,
since a step reads only a few of its rows): per group of 32 consecutive inputs of an output, a bf16
``scale = (max - min) / (2^bits - 1)`` and ``zero = min``, and codes ``round((w - zero) / scale)``, so
a weight is ``fma(code, scale, zero)``: 1.125 (int8) or 0.625 (int4) bytes per weight against bf16's 2.
The embedded qwen2.5-coder-0.5b GGUF is mostly Q5_0 (``d (q - 16)``, 32 levels per 32 weights): against
its bf16 weights ``int8`` has about 0.5 % relative error per tensor (the Q5_0 levels do not fall on
its grid of 255 steps between min and max) and ``int4`` about 8 % (``benchmarks/weights_format.py``).

Decode-sized inputs (at most :data:`pask.cpu.native_gemv.MAX_ROWS` rows) run
:func:`pask.cpu.native_gemv.linear_quant`: on AMX-INT8 tiles where the CPU has them, with the
input quantised to int8 per group of 32 (``int8``'s codes are the tiles themselves; ``int4``'s are
unpacked first); elsewhere the bf16 kernels over rows dequantised 64 at a time. Larger inputs
(prefills) dequantise the weight (in pieces of :data:`PREFILL_ROWS` outputs) and multiply as the
bf16 model would (:func:`pask.cpu.bf16_matmul.bounded_linear` on CPUs with BF16 arithmetic, fp32
products elsewhere). Every path is batch-invariant. The formats need the native kernels: with
``PASK_NATIVE=0`` they are refused.

The format is chosen per process: ``load_model(..., weights=...)``, ``--weights`` on the commands,
``weights = "int4"`` in a sweep config, or ``PASK_WEIGHTS`` (default ``bf16``). It is part of the
model's fingerprint (the prefill store keeps the formats apart) and of a sweep cell's identity.
"""

from __future__ import annotations

import os
import threading

import torch
import torch.nn.functional as F

from pask.errors import PaskError

FORMATS = ("bf16", "int8", "int4")
BITS = {"int8": 8, "int4": 4}
GROUP = 32  # input values per (scale, zero)
PREFILL_ROWS = 16384  # outputs dequantised at a time for a prefill (a multiple of 16)
ENV = "PASK_WEIGHTS"


def configured(weights: str | None = None) -> str:
    """``weights``, or ``PASK_WEIGHTS`` (default ``bf16``) when None; a clear error for an unknown one."""
    w = weights if weights is not None else (os.environ.get(ENV, "").strip().lower() or "bf16")
    if w not in FORMATS:
        raise PaskError(f"weight format must be one of {', '.join(FORMATS)}, got {w!r}")
    return w


def quantize(weight: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, sz)`` of a ``[N, K]`` weight (K a multiple of 32) in the kernels' tiled layout
    (``native_gemv.cpp``): outputs in blocks of 16 (N padded with zero rows), inputs in groups of 32,
    per (block, group) the eight rows of an AMX-INT8 B tile (row r: 16 outputs x inputs 4 r .. 4 r + 3,
    byte 4 n + i): ``codes [Np/16, K/32, 8, 64]`` uint8 for 8 bits; for 4 bits ``[Np/16, K/32, 4, 64]``,
    byte of row r holding tile row r (low nibble) and r + 4 (high nibble). ``sz [Np/16, K/32, 2, 16]``
    bf16: the block's 16 scales, then its 16 zeros."""
    if bits not in (4, 8):
        raise PaskError(f"quantised weights have 4 or 8 bits, not {bits}")
    if weight.dim() != 2 or weight.shape[1] % GROUP != 0 or 0 in weight.shape:
        shape = tuple(weight.shape)
        raise PaskError(f"INT{bits} weights need a 2-d weight with a multiple of {GROUP} inputs, got {shape}")
    n, k = weight.shape
    groups = k // GROUP
    g = weight.detach().float().reshape(n, groups, GROUP)
    if not torch.isfinite(g).all():
        raise PaskError(f"INT{bits} weights: the weight has non-finite values")
    levels = (1 << bits) - 1
    lo, hi = g.amin(-1), g.amax(-1)
    scale, zero = ((hi - lo) / levels).to(torch.bfloat16), lo.to(torch.bfloat16)
    s, z = scale.float().unsqueeze(-1), zero.float().unsqueeze(-1)
    q = torch.where(s > 0, (g - z) / torch.where(s > 0, s, 1.0), 0.0).round().clamp(0, levels).to(torch.uint8)
    npad = -(-n // 16) * 16
    if npad != n:  # zero rows: scale 0, zero 0, code 0
        q = torch.cat([q, q.new_zeros(npad - n, groups, GROUP)])
        scale = torch.cat([scale, scale.new_zeros(npad - n, groups)])
        zero = torch.cat([zero, zero.new_zeros(npad - n, groups)])
    nb = npad // 16
    rows = q.reshape(nb, 16, groups, 8, 4).permute(0, 2, 3, 1, 4)  # [b, g, r, n, i]
    if bits == 4:
        rows = rows[:, :, :4] | (rows[:, :, 4:] << 4)
    codes = rows.reshape(nb, groups, -1, 64).contiguous()
    sz = torch.stack([scale.reshape(nb, 16, groups), zero.reshape(nb, 16, groups)], 2)  # [b, n, 2, g]
    return codes, sz.permute(0, 3, 2, 1).contiguous()


def codes_of(codes: torch.Tensor) -> torch.Tensor:
    """The ``[Np, K]`` integer codes of a tiled weight (either width; the inverse of :func:`quantize`'s layout)."""
    nb, groups = codes.shape[0], codes.shape[1]
    c = codes.reshape(nb, groups, -1, 16, 4)  # [b, g, r, n, i]
    if c.shape[2] == 4:
        c = torch.cat([c & 15, c >> 4], 2)
    return c.permute(0, 3, 1, 2, 4).reshape(nb * 16, groups * GROUP)


def scales_of(sz: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``[Np, K/32]`` bf16 scales and zeros of a tiled weight (the inverse of :func:`quantize`'s layout)."""
    nb, groups = sz.shape[0], sz.shape[1]
    return tuple(sz[:, :, j, :].permute(0, 2, 1).reshape(nb * 16, groups) for j in (0, 1))


def dequantize_reference(codes: torch.Tensor, sz: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """The ``[N, K]`` fp32 weight ``code * scale + zero`` of a tiled weight (before any bf16
    rounding), in PyTorch. ``n`` cuts the padding rows."""
    nb, groups = codes.shape[0], codes.shape[1]
    q = codes_of(codes).reshape(nb * 16, groups, GROUP).float()
    scale, zero = (t.float().unsqueeze(-1) for t in scales_of(sz))
    w = (q * scale + zero).reshape(nb * 16, groups * GROUP)
    return w if n is None else w[:n]


class QuantLinear(torch.nn.Module):
    """An ``nn.Linear`` with an INT4 / INT8 weight (:func:`quantize`); outputs in the input's dtype."""

    def __init__(
        self, codes: torch.Tensor, sz: torch.Tensor, out_features: int, bits: int, bias: torch.Tensor | None
    ) -> None:
        super().__init__()
        self.out_features, self.in_features, self.bits = out_features, codes.shape[1] * GROUP, bits
        self.register_buffer("codes", codes)
        self.register_buffer("sz", sz)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, bits: int) -> QuantLinear:
        codes, sz = quantize(linear.weight, bits)
        return cls(codes, sz, linear.out_features, bits, linear.bias)

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, bias={bias}"

    def weight_bytes(self) -> int:
        """Bytes of the codes and scales (what a decode step reads)."""
        return self.codes.numel() * self.codes.element_size() + self.sz.numel() * self.sz.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from pask.cpu import bf16_matmul, native_gemv

        if x.numel() <= native_gemv.MAX_ROWS * self.in_features and x.dtype == torch.bfloat16:
            return native_gemv.linear_quant(x, self.codes, self.sz, self.out_features, self.bits, self.bias)
        outs = []
        for n0 in range(0, self.out_features, PREFILL_ROWS):  # a large head: bounded scratch per call
            n1 = min(self.out_features, n0 + PREFILL_ROWS)
            w = native_gemv.dequant(
                self.codes[n0 // 16 :], self.sz[n0 // 16 :], n1 - n0, self.bits, _scratch(n1 - n0, self.in_features)
            )
            b = None if self.bias is None else self.bias[n0:n1]
            if x.dtype == torch.bfloat16 and bf16_matmul.cpu_has_bf16():
                outs.append(bf16_matmul.bounded_linear(x, w, b))
            else:
                outs.append(F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype))
        return outs[0] if len(outs) == 1 else torch.cat(outs, -1)


_SCRATCH = threading.local()


def dense_weight(linear: torch.nn.Module) -> torch.Tensor | None:
    """The ``[out, in]`` weight a linear layer multiplies by: an ``nn.Linear``'s own, a
    :class:`QuantLinear`'s dequantised into a fresh bf16 tensor (bit-exact with its prefill path);
    None for anything else. For code that reads a projection's weight (the value-output norms of
    :mod:`pask.kv.stats`)."""
    if isinstance(linear, QuantLinear):
        from pask.cpu import native_gemv

        return native_gemv.dequant(linear.codes, linear.sz, linear.out_features, linear.bits)
    weight = getattr(linear, "weight", None)
    return weight if isinstance(weight, torch.Tensor) else None


def _scratch(rows: int, cols: int) -> torch.Tensor:
    """A bf16 ``[rows, cols]`` buffer for a prefill's dequantised weight, kept per thread and grown to
    the largest seen: a prefill then writes its weights into memory it already owns (a fresh
    allocation per layer faulted in up to a gigabyte of pages per prefill)."""
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.numel() < rows * cols:
        buf = _SCRATCH.buf = torch.empty(rows * cols, dtype=torch.bfloat16)
    return buf[: rows * cols].view(rows, cols)


def apply(model: torch.nn.Module, weights: str | None = None) -> dict:
    """Put ``model``'s linear layers in the weight format (``bf16``: unchanged; ``int8`` / ``int4``:
    :class:`QuantLinear`). Returns what changed:
    ``weights``, ``layers`` (linears converted), ``bytes_before`` / ``bytes_after`` (their weights)."""
    fmt = configured(weights)
    report = {"weights": fmt, "layers": 0, "bytes_before": 0, "bytes_after": 0}
    if fmt == "bf16":
        return report
    from pask.cpu import native, native_gemv

    if native.disabled() or not native_gemv.available():
        raise PaskError(f"--weights {fmt} needs pask's native kernels (native gemv: {native_gemv.status()})")
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and child.in_features % GROUP == 0 and child.weight.device.type == "cpu":
                q = QuantLinear.from_linear(child, BITS[fmt])
                report["layers"] += 1
                report["bytes_before"] += child.weight.numel() * child.weight.element_size()
                report["bytes_after"] += q.weight_bytes()
                setattr(parent, name, q)
    if report["layers"] == 0:
        raise PaskError(f"--weights {fmt}: the model has no linear layer to quantise")
    return report


def step_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights a decode step reads: every linear layer's weight (INT4: codes and scales) and
    bias, and every other parameter (norms), but not an embedding table's (a step reads a few of its
    rows; a tied LM head's weight counts as that linear's)."""
    seen: set[int] = set()
    total = 0

    def add(t: torch.Tensor | None) -> None:
        nonlocal total
        if t is not None and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()

    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear):
            add(mod.weight)
            add(mod.bias)
        elif isinstance(mod, QuantLinear):
            add(mod.codes)
            add(mod.sz)
            add(mod.bias)
    embeddings = {m.weight.data_ptr() for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    for p in model.parameters():
        if p.data_ptr() not in embeddings:
            add(p)
    return total
