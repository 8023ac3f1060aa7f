"""Low-bit packing of K/V vectors (INT4, and INT2 for the 2-bit tier): per-group asymmetric scale/zero.

A vector ``x`` of ``D`` values is split into ``D // group`` groups. Each group keeps
``zero = min`` and ``scale = (max - min) / 15`` as float16, and each value the 4-bit code
``q = round((x - zero) / scale)`` so that ``x ≈ q * scale + zero``.

Two codes share one byte in "split halves" order: byte ``j`` holds element ``j`` in its
low nibble and element ``j + D/2`` in its high nibble. Unpacking is then two vectorised
ops (``& 15`` and ``>> 4``) and a concatenation, and for ``D = 64`` the layout is also the
one PyTorch's CPU int4 GEMM reads (see :mod:`pask.kv.fastpath`).

Bytes per vector: ``D/2 + 2 * (D/group) * 2``; 0.3125 of BF16 at ``D = 64, group = 32``.

INT2 (``bits=2``, codes 0..3) packs four codes per byte, adjacent: byte ``j`` holds codes
``4j .. 4j+3`` at bit offsets 0, 2, 4, 6 (:func:`pack_quads`). Bytes per vector:
``D/4 + 2 * (D/group) * 2``; 0.1875 of BF16 at ``D = 64, group = 32``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pask.kv.errors import KVCacheError, UnsupportedModelError

QMAX = 15
BITS = (2, 4)  # the code widths a low tier can hold


@dataclass
class Int4Tensor:
    """Packed INT4 vectors: ``packed`` uint8 [..., D/2], ``scale``/``zero`` fp16 [..., D/group]."""

    packed: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group: int

    @property
    def head_dim(self) -> int:
        return self.packed.shape[-1] * 2

    def nbytes(self) -> int:
        """Bytes held by the three tensors."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.zero))


def check_group(head_dim: int, group: int) -> None:
    """Raise if ``head_dim`` cannot be packed with this group size."""
    if head_dim % 2 or group <= 0 or head_dim % group:
        raise UnsupportedModelError(
            "INT4 packing needs an even head_dim divisible by the quantisation group: "
            f"head_dim={head_dim}, group={group}"
        )


def check_bits(bits: int) -> int:
    """``bits`` if a low tier can hold codes of that width (2 or 4), else KVCacheError."""
    if bits not in BITS:
        raise KVCacheError(f"low-bit codes must be 2 or 4 bits wide, got {bits!r}")
    return bits


def lowbit_bytes_per_vector(head_dim: int, group: int = 32, bits: int = 4) -> int:
    """Bytes of one packed vector of ``head_dim`` ``bits``-bit codes + 2-byte scale and zero per group."""
    check_group(head_dim, group)
    if check_bits(bits) == 2 and head_dim % 4:
        raise UnsupportedModelError(f"INT2 packing needs head_dim divisible by 4, got {head_dim}")
    return head_dim * bits // 8 + 2 * (head_dim // group) * 2


def int4_bytes_per_vector(head_dim: int, group: int = 32) -> int:
    """Bytes of one packed INT4 vector of ``head_dim`` values (codes + fp16 scale and zero)."""
    return lowbit_bytes_per_vector(head_dim, group, 4)


def _round_down(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Largest ``dtype`` value <= x (x in fp32)."""
    h = x.to(dtype)
    over = h.float() > x
    return torch.where(over, torch.nextafter(h, torch.full_like(h, -torch.inf)), h)


def _round_up(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Smallest ``dtype`` value >= x (x in fp32)."""
    h = x.to(dtype)
    under = h.float() < x
    return torch.where(under, torch.nextafter(h, torch.full_like(h, torch.inf)), h)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack integer codes 0..15 [..., D] into uint8 [..., D/2] (split-halves order)."""
    half = codes.shape[-1] // 2
    c = codes.to(torch.uint8)
    return c[..., :half] | (c[..., half:] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: uint8 [..., D/2] -> uint8 codes [..., D]."""
    return torch.cat([packed & 15, packed >> 4], dim=-1)


def pack_pairs(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes [..., n] as adjacent pairs: byte ``j`` = code ``2j`` | code ``2j + 1`` << 4 -> [..., n/2]."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_pairs(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_pairs`."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)


def pack_quads(codes: torch.Tensor) -> torch.Tensor:
    """Pack 2-bit codes 0..3 [..., n] four per byte: byte ``j`` = codes ``4j + i`` << ``2i`` -> [..., n/4]."""
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // 4, 4)
    return c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)


def unpack_quads(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_quads`: uint8 [..., n/4] -> uint8 codes [..., n]."""
    return torch.stack([(packed >> s) & 3 for s in (0, 2, 4, 6)], dim=-1).flatten(-2)


def quantize_codes(
    x: torch.Tensor,
    group: int = 32,
    zero_point: int = 0,
    scale_dtype: torch.dtype = torch.float16,
    bits: int = 4,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantise ``x`` [..., D] to codes uint8 [..., D] (0..2^bits-1; bits 2, 4 or 8) and scale/zero [..., D/group].

    ``x ≈ (code - zero_point) * scale + zero``; ``zero_point = 0`` gives ``zero = min`` (the
    :class:`Int4Tensor` format), ``zero_point = 8`` the form PyTorch's int4 GEMM reads. The
    ``scale_dtype`` (fp16 by default; the cache's INT4 tier uses bf16, what that GEMM reads)
    ``zero`` and ``scale`` are rounded so that every value lies in the covered range
    ``[zero - zero_point * scale, ... + qmax * scale]`` (``qmax = 2^bits - 1``): the round-trip error
    is at most ``scale / 2`` (plus fp32 rounding).
    """
    d = x.shape[-1]
    check_group(d, group)
    if bits != 8:  # 8: BellowsKV's INT8 latent (pask.kv.latent); the K/V tiers hold 4 or 2
        check_bits(bits)
    qmax = (1 << bits) - 1
    xg = x.float().reshape(*x.shape[:-1], d // group, group)
    mn = xg.amin(dim=-1)
    mx = xg.amax(dim=-1)
    scale = _round_up((mx - mn) / qmax, scale_dtype)
    scale = torch.where(scale > 0, scale, torch.full_like(scale, 2.0**-24))
    while True:  # rounding zero down may leave mx above the top code: widen those groups
        zero = _round_down(mn + zero_point * scale.float(), scale_dtype)
        low = zero.float() - zero_point * scale.float()  # value of code 0
        short = low + qmax * scale.float() < mx
        if not bool(short.any()):
            break
        scale = torch.where(short, torch.nextafter(scale, torch.full_like(scale, torch.inf)), scale)
    codes = torch.round((xg - low[..., None]) / scale.float()[..., None]).clamp_(0, qmax)
    return codes.reshape(*x.shape[:-1], d).to(torch.uint8), scale, zero


def quantize_int4(x: torch.Tensor, group: int = 32) -> Int4Tensor:
    """Quantise ``x`` [..., D] to packed INT4 with fp16 scale/zero per group of ``group`` values."""
    codes, scale, zero = quantize_codes(x, group)
    return Int4Tensor(packed=pack_nibbles(codes), scale=scale, zero=zero, group=group)


def dequantize_codes(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype=torch.float32, zero_point: int = 0
) -> torch.Tensor:
    """``(codes - zero_point) * scale + zero`` per group: codes [..., D], scale/zero [..., D/group] -> [..., D]."""
    d = codes.shape[-1]
    groups = scale.shape[-1]
    g = codes.reshape(*codes.shape[:-1], groups, d // groups).float()
    low = zero.float() - zero_point * scale.float()
    out = g * scale.float()[..., None] + low[..., None]
    return out.reshape(*codes.shape[:-1], d).to(dtype)


def dequantize_parts(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Dequantise raw parts (see :class:`Int4Tensor`) to ``dtype`` [..., D]."""
    codes = unpack_nibbles(packed)
    if codes.shape[-1] // group != scale.shape[-1]:
        raise ValueError(f"{codes.shape[-1]} values with group {group} need {codes.shape[-1] // group} scales")
    return dequantize_codes(codes, scale, zero, dtype)


def dequantize_int4(q: Int4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantise an :class:`Int4Tensor` to ``dtype`` [..., D]."""
    return dequantize_parts(q.packed, q.scale, q.zero, q.group, dtype)
