"""Native decode attention over the tiered cache: one C++ call per layer for the whole batch.

``native_attention.cpp`` reads each sequence's BF16, packed INT4 and packed INT2 tiers in place
(the layouts of :mod:`pask.kv.storage`), computes low-bit key scores from the codes without
dequantising a key (per-group scale and zero applied to code dot products, all query rows of a kv
head sharing one pass over the codes), and merges the three streams in one FP32 online softmax; sequences x kv heads
run in parallel (OpenMP, ``torch.get_num_threads()`` threads). It replaces the per-sequence Python
path (PyTorch's flash kernel + six int4-GEMM calls per sequence and layer), whose fixed cost and
compute-bound INT4 GEMM made an INT4 token slower to read than a BF16 one on this CPU.

Build: compiled on first use by :mod:`pask.cpu.native` (``-O3 -march=native -fopenmp``; AVX-512 or
AVX2 + FMA kernels where the CPU has them, portable loops otherwise). Where the CPU has AMX (BF16
tiles) and the OS grants tile state, both tiers run on tiles, each in two passes (every score of
the tier, one softmax step, then the values in tile accumulators): BF16 keys read in place against
the bf16 query (exact products); INT4 codes widened to exact bf16; fp32 query rows (INT4) and
weights split into two bf16 parts (FP32-level accuracy) (:func:`use_amx`, ``PASK_AMX=0``). A start-up
probe checks the library against the reference attention on random tiers. ``PASK_NATIVE=0``
disables it (:func:`available` is False and the previous paths run). Without a compiler, without
the source (a broken install), or if the probe fails, :func:`available` raises
:class:`pask.cpu.native.NativeKernelError` with the reason; ``PASK_ALLOW_FALLBACK=1`` makes it warn
and return False instead (the previous paths run; :func:`pask.cpu.native.unavailable`).
:func:`status` reports the state without raising.
"""

from __future__ import annotations

import contextlib
import ctypes
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from pask.cpu import native

SOURCE = Path(__file__).parents[1] / "cpu" / "native_attention.cpp"
FLAGS = [*native.COMMON_FLAGS, "-mprefer-vector-width=512"]
FLAGS += ["-ffp-contract=off"]  # no fused multiply-add where PyTorch rounds twice (the INT4 move)
MAX_ROWS, MAX_DIM, GROUP = 16, 128, 32  # query rows per kv head, head_dim, quantisation group

_LIB: ctypes.CDLL | None = None
_FIELDS = 19  # fields of decode_layer's per-row descriptor
_REFERENCE_CHECK: Callable[[], float | None] | None = None


def library_path() -> Path:
    """Where the compiled library lives (built if missing); raises RuntimeError without a compiler."""
    return native.build(SOURCE, FLAGS)


def _load() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(library_path()))
    f = lib.pask_decode_layer
    vp = ctypes.c_void_p
    # the per-row arrays are addresses into one flat int64 descriptor built per call: all void*
    f.argtypes = [ctypes.c_int] * 4 + [ctypes.c_float, vp] + [vp] * 4 + ([vp] * 5 + [vp, vp]) * 2
    f.argtypes += [ctypes.c_int, vp, vp, ctypes.c_int, vp]
    f.restype = ctypes.c_int
    m = lib.pask_move_to_low
    m.argtypes = [ctypes.c_int] * 3 + [vp] + [ctypes.c_int] * 3
    m.restype = ctypes.c_int
    b = lib.pask_quantize_low
    b.argtypes = [ctypes.c_int, ctypes.c_int, vp, vp, ctypes.c_int64] + [vp] * 5
    b.argtypes += [ctypes.c_int64, ctypes.c_int64, vp, ctypes.c_int, ctypes.c_int, ctypes.c_int, vp, ctypes.c_int64]
    b.restype = ctypes.c_int
    a = lib.pask_append_h
    a.argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.c_int, vp, vp, vp, vp, vp, vp]
    a.restype = ctypes.c_int
    r = lib.pask_key_range
    r.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int, vp, ctypes.c_int64, vp, vp]
    r.restype = ctypes.c_int
    lib.pask_attention_isa.restype = ctypes.c_char_p
    lib.pask_attention_use_amx.argtypes = [ctypes.c_int]
    lib.pask_attention_use_amx.restype = ctypes.c_int
    lib.pask_attention_use_int8.argtypes = [ctypes.c_int]
    lib.pask_attention_use_int8.restype = ctypes.c_int
    return lib


def _probe() -> str:
    """Build, load and compare with the reference attention on random tiers; "ok" or the reason.

    The comparison is :func:`pask.kv.attention.native_agreement` (it builds tiered caches, which
    live above this module), registered through :func:`set_reference_check`."""
    global _LIB
    lib, why = native.try_load(_load)
    if why:
        return why
    _LIB = lib
    if _REFERENCE_CHECK is None:
        _LIB = None
        return "unavailable: no reference check registered (import pask.kv first)"
    int8 = lib.pask_attention_use_int8(-1)  # the probe checks the exact path (use_int8 is bounded apart)
    lib.pask_attention_use_int8(0)
    try:
        err = _REFERENCE_CHECK()
    finally:
        lib.pask_attention_use_int8(int8)
    if err is not None:
        _LIB = None
        return f"probe mismatch (max abs error {err:.4f})"
    return "ok"


_PROBE = native.Probe("native attention", "the PyTorch path", _probe)
available = _PROBE.available  # whether the kernel is built, loaded and probed (raises unless PASK_ALLOW_FALLBACK=1)
status = _PROBE.status  # "ok" or why the kernel is not used (never raises)


def set_reference_check(check: Callable[[], float | None]) -> None:
    """Register the probe's comparison with the reference attention: ``None`` if the kernel agrees,
    else the largest error (called once, with the library loaded, by :func:`available`)."""
    global _REFERENCE_CHECK
    _REFERENCE_CHECK = check


def use_amx(on: bool) -> bool:
    """Turn the AMX tiles for the INT4 tier on or off (on by default where the CPU and OS allow;
    ``PASK_AMX=0`` starts with them off); returns whether they are on now."""
    if _LIB is None and not available():
        return False
    return bool(_LIB.pask_attention_use_amx(int(on)))


def use_int8(on: bool | None = None) -> bool:
    """Turn the AVX2 build's integer path for the INT4 tier on or off (``None``: leave it); returns
    whether it is on now (always False on other builds).

    Scores take the balanced query rows in int8 per (row, 32-channel group) and values the softmax
    weights in u8 per (row, 64-slot block), both against their largest magnitude, through
    ``pmaddubsw``: an error bounded in ``tests/test_int8_attention.py``, not FP32-level. On by
    default on the AVX2 build (``PASK_INT8_ATTENTION=0`` starts with it off, the exact path that the
    FP32-exactness tests hold; docs/kernels.md#avx2-paths)."""
    if _LIB is None and not available():
        return False
    return bool(_LIB.pask_attention_use_int8(-1 if on is None else int(on)))


@contextlib.contextmanager
def int8_path(on: bool) -> Iterator[bool]:
    """The AVX2 build's integer INT4 path turned on or off (:func:`use_int8`) for a ``with`` block,
    the previous setting restored after it; yields whether the path is on inside the block."""
    before = use_int8()
    try:
        yield use_int8(on)
    finally:
        use_int8(before)


def isa() -> str | None:
    """The instruction set the kernels run (``avx512+amx``, ``avx512``, ``avx2+int8``, ``avx2``,
    ``portable``), or None."""
    return _LIB.pask_attention_isa().decode() if status() == "ok" and _LIB is not None else None


def applies(query: torch.Tensor, layer) -> bool:
    """Whether :func:`decode_layer` serves this decode query ``[B, Hq, 1, D]`` on this layer."""
    cfg = layer.cache.config
    spec = layer.cache.spec
    grp = spec.num_q_heads // spec.num_kv_heads
    return (
        query.device.type == "cpu"
        and query.dtype == torch.bfloat16
        and layer.dtype == torch.bfloat16
        and query.shape[2] == 1
        and query.shape[-1] % GROUP == 0
        and query.shape[-1] <= MAX_DIM
        and grp <= MAX_ROWS
        and cfg.quant_group == GROUP
        and available()
    )


def _ptr(t: torch.Tensor | None) -> int | None:
    if t is None:
        return None
    if not t.is_contiguous():
        raise RuntimeError("native attention needs contiguous tier storage")
    return t.data_ptr()


def decode_layer(layer, query: torch.Tensor, scaling: float, weights: bool = False, fp32: bool = False):
    """Decode attention of ``query [B, Hq, 1, D]`` (bf16) over every sequence of ``layer`` -> ``[B, 1, Hq, D]``.

    ``weights=True`` returns ``(out, probs)`` instead: per row (None for a dropped row) the fp32
    softmax weights ``[Hkv, n_H + n_L + n_L2]`` of its H slots, then its INT4 slots, then its INT2
    slots, averaged over the query heads of each kv head (the kernel's own weights, from its exp;
    what :func:`explicit_decode` computes in PyTorch). ``fp32=True``: the kernel's fp32 output, not
    rounded to the query's dtype (for error bounds).
    """
    if _LIB is None and not available():
        raise RuntimeError(f"pask native attention is {status()}")
    bsz, hq, _, d = query.shape
    spec = layer.cache.spec
    hkv = spec.num_kv_heads
    q = query[:, :, 0, :].contiguous()
    out = torch.empty(bsz, hq, d, dtype=torch.float32)
    seqs = layer.seqs
    # one flat int64 descriptor, each field ``bsz`` wide (0: no tokens / no pointer), in the
    # kernel's argument order: kh vh hcap hn | kq ksz vq vs vz lcap ln | the same for L2 | kbal
    vals = [0] * (_FIELDS * bsz)
    for b in range(min(bsz, len(seqs))):
        st = seqs[b]
        if st is None:
            continue
        h = st.h
        if h.n:
            p = h.ptrs
            vals[b], vals[bsz + b], vals[2 * bsz + b], vals[3 * bsz + b] = p[0], p[1], h.cap, h.n
        for base, tier in ((4, st.l), (11, st.l2)):
            if tier.n:
                p = tier.ptrs
                for i in range(5):
                    vals[(base + i) * bsz + b] = p[i]
                vals[(base + 5) * bsz + b], vals[(base + 6) * bsz + b] = tier.cap, tier.n
                vals[18 * bsz + b] = st.kbal.data_ptr()
    desc = (ctypes.c_int64 * len(vals))(*vals)
    at = ctypes.addressof(desc)
    field = [at + 8 * bsz * i for i in range(_FIELDS)]
    kbits2 = layer.cache.config.l2_key_bits  # every store of the cache has the config's L2 key width
    probs = None
    probs_arr = None
    if weights:
        live = [b < len(seqs) and seqs[b] is not None for b in range(bsz)]
        width = [vals[3 * bsz + b] + vals[10 * bsz + b] + vals[17 * bsz + b] for b in range(bsz)]
        probs = [torch.empty(hkv, width[b]) if live[b] else None for b in range(bsz)]
        probs_arr = (ctypes.c_void_p * bsz)(*[None if p is None else p.data_ptr() for p in probs])
    rc = _LIB.pask_decode_layer(
        bsz, hkv, hq // hkv, d, float(scaling), q.data_ptr(), *field[:18], kbits2, field[18],
        out.data_ptr(), torch.get_num_threads(), probs_arr,
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"native attention rejected the shape (Hkv {hkv}, Hq {hq}, D {d})")
    out = out.view(bsz, 1, hq, d)
    out = out if fp32 else out.to(query.dtype)
    return (out, probs) if weights else out


def move_applies(stores: list, bits: int = 4) -> bool:
    """Whether :func:`move_to_low` serves these stores (bf16 H tiers, key balance already fixed)."""
    st = stores[0]
    return (
        st.group == GROUP
        and bits in (2, 4)
        and st.h.parts["k"].dtype == torch.bfloat16
        and all(s.kbal is not None for s in stores)
        and available()
    )


_MOVE_FIELDS = 13  # int64 per store in pask_move_to_low's descriptor (its MOVE_FIELDS)


def move_to_low(moves: list[tuple[list, int, int, int]], bits: int = 4) -> None:
    """For each ``(stores, slot, last, lslot)`` of ``moves`` (the layers of one sequence's layer
    group, e.g. every row's token leaving its recent window in a decode step), in order: quantise H
    slot ``slot`` of each store into slot ``lslot`` of its ``bits`` tier (4: L, 2: L2) and move H
    slot ``last`` into ``slot``; bit-exact with :meth:`_SeqStore.append_low`. One native call for
    all of them. The low tiers must already hold capacity for ``lslot``; the caller updates the counts."""
    vals = array("q")
    for group, slot, last, lslot in moves:
        for st in group:
            h, lo = st.h, st.low(bits)
            if not (h.ptrs and lo.ptrs):
                raise RuntimeError("native low-bit move needs allocated H and low tiers (reserve first)")
            # one store's fields, in the kernel's order: hk hv hcap slot last kq ksz vq vs vz lcap lslot kbal
            vals.extend((*h.ptrs[:2], h.cap, slot, last, *lo.ptrs, lo.cap, lslot, st.kbal.data_ptr()))
    n = len(vals) // _MOVE_FIELDS
    if not n:
        return
    at, _ = vals.buffer_info()
    st0 = moves[0][0][0]
    d = st0.h.parts["k"].post[0]
    rc = _LIB.pask_move_to_low(n, st0.h.heads, d, at, bits, st0.key_bits(bits), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"native low-bit move rejected the shape or a slot (head_dim {d}, {bits} bits)")


def append_h(stores: list, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Append token ``b`` of ``k, v [rows, Hkv, 1, D]`` (bf16) to the H tier of ``stores[b]`` (rows
    whose store is None are skipped) in one native call; False, with nothing written, where it does
    not apply (the caller then appends row by row)."""
    if not (k.dtype == torch.bfloat16 and v.dtype == torch.bfloat16 and k.shape[2] == 1 and available()):
        return False
    live = [st for st in stores if st is not None]
    if not live or live[0].h.parts["k"].dtype != torch.bfloat16:
        return False
    rows, hkv, _, d = k.shape
    k, v = k.contiguous(), v.contiguous()  # (held until the call returns)
    for st in live:
        st.h.reserve(1)
    vals = [0] * (4 * rows)  # one flat descriptor: kh vh cap n, each ``rows`` wide (0: skipped row)
    for b, st in enumerate(stores):
        if st is not None:
            h = st.h
            vals[b], vals[rows + b], vals[2 * rows + b], vals[3 * rows + b] = h.ptrs[0], h.ptrs[1], h.cap, h.n
    desc = (ctypes.c_int64 * len(vals))(*vals)
    at = ctypes.addressof(desc)
    rc = _LIB.pask_append_h(rows, hkv, d, k.data_ptr(), v.data_ptr(), *(at + 8 * rows * i for i in range(4)))
    if rc != 0:
        raise RuntimeError(f"native H-tier append rejected the shape (Hkv {hkv}, D {d})")
    for st in live:
        st.h.commit(1)
    return True


def key_range(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per-channel max and min ``[Hkv, D]`` (fp32) of ``keys [Hkv, n, D]`` (bf16, each head's rows
    contiguous, as the H tier's view), the same values as ``keys.float().amax(1)`` / ``amin(1)``
    without the fp32 copy; None where it does not apply (the caller then takes PyTorch's)."""
    if not (keys.dtype == torch.bfloat16 and keys.dim() == 3 and keys.device.type == "cpu" and keys.shape[1] > 0):
        return None
    heads, n, d = keys.shape
    if d > MAX_DIM or keys.stride(2) != 1 or keys.stride(1) != d or not available():
        return None
    hi = torch.empty(heads, d, dtype=torch.float32)
    lo = torch.empty(heads, d, dtype=torch.float32)
    rc = _LIB.pask_key_range(heads, n, d, keys.data_ptr(), keys.stride(0), hi.data_ptr(), lo.data_ptr())
    if rc != 0:
        raise RuntimeError(f"native key range rejected the shape (head_dim {d})")
    return hi, lo


def quantize_low(store, k: torch.Tensor, v: torch.Tensor, bits: int = 4, slots: torch.Tensor | None = None) -> bool:
    """Append ``k, v [Hkv, n, D]`` (bf16) to ``store``'s ``bits`` tier with the native quantiser (bit-exact
    with the PyTorch path of :meth:`_SeqStore.append_low`, parallel over kv heads and 64-slot blocks);
    False, with nothing written, where it does not apply (the caller then takes the PyTorch path).
    ``slots`` (int64): append rows ``slots`` of ``k, v [Hkv, cap, D]`` (the store's H tier) instead,
    read in place rather than gathered first."""
    if not (
        store.group == GROUP
        and bits in (2, 4)
        and store.kbal is not None
        and k.dtype == torch.bfloat16
        and v.dtype == torch.bfloat16
        and k.shape[-1] <= MAX_DIM
        and available()
    ):
        return False
    heads, cap, d = k.shape
    if slots is not None:
        if not (k.is_contiguous() and v.is_contiguous() and slots.dtype == torch.long):
            return False
        slots = slots.contiguous()
        n = slots.numel()
    else:
        k, v = k.contiguous(), v.contiguous()
        n = cap
    lt = store.low(bits)
    lslot = lt.n
    lt.reserve(n)
    t = lt.t
    rc = _LIB.pask_quantize_low(
        heads, d, k.data_ptr(), v.data_ptr(), n,
        *(_ptr(t[x]) for x in ("kq", "ksz", "vq", "vs", "vz")),
        lt.cap, lslot, _ptr(store.kbal), bits, store.key_bits(bits), torch.get_num_threads(),
        None if slots is None else slots.data_ptr(), cap,
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"native low-bit quantiser rejected the shape or a slot (head_dim {d}, {bits} bits)")
    lt.commit(n)
    return True
