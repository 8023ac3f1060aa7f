"""Storage of the tiered cache: dense token-slot tiers, the INT4 / INT2 layouts and the position index.

* :class:`_Tier`: tensors ``[heads, *pre, capacity, *post]`` with ``n`` live slots; tail appends with
  capacity doubling, swap-removes (the last live slots move into the holes), shrinking when the
  live part falls under ``shrink_below`` of the capacity, and ``compact()``.
* :class:`_BlockedCodes`: INT4 key codes, 64-slot blocks stored d-major.
* :class:`_GroupIndex`: per (sequence, layer group), the tier and slot of every position and the
  position of every slot, shared by the layers of the group.
* :class:`_SeqStore`: one sequence's tiers in one layer: H (model dtype), L (INT4 codes) and L2
  (INT2 codes), each allocated on its first token, and the cold tier (KVFetch's recall channel:
  low-bit copies of released tokens that attention never reads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pask.kv.actions import Action
from pask.kv.quant import (
    check_bits,
    dequantize_codes,
    pack_pairs,
    pack_quads,
    quantize_codes,
    unpack_pairs,
    unpack_quads,
)

if TYPE_CHECKING:
    from pask.kv.config import CacheConfig
    from pask.kv.latent import LatentTier

H, L, R, L2 = int(Action.H), int(Action.L), int(Action.R), int(Action.L2)
TIERS = (H, L, L2)  # the tiers that hold bytes (R holds none)


@dataclass
class CopyStats:
    """Storage reallocations done by the cache (for the amortised-append guarantee)."""

    reallocs: int = 0
    copied_bytes: int = 0
    appended_bytes: int = 0


SCALE_DTYPE = torch.bfloat16  # INT4-tier scales/zeros: 2 bytes like fp16, and what the int4 GEMM reads
BLOCK = 64  # INT4 key block: 64 token slots, stored d-major (see _BlockedCodes)


def key_zero_point(bits: int) -> int:
    """Zero point of ``bits``-bit key codes (``k' = (c - zp) * scale + zero``): 8 for INT4, as PyTorch's
    int4 GEMM reads them, 2 for INT2."""
    return 1 << (bits - 1)


class _Plain:
    """A part stored as ``[heads, *pre, capacity, *post]``: slot axis ``1 + len(pre)``."""

    def __init__(self, pre: tuple[int, ...], post: tuple[int, ...], dtype: torch.dtype):
        self.pre, self.post, self.dtype = pre, post, dtype
        self.dim = 1 + len(pre)

    def alloc(self, heads: int, cap: int, device) -> torch.Tensor:
        # zero-filled: slots past n then always hold finite values (the fused path reads whole blocks)
        return torch.zeros((heads, *self.pre, cap, *self.post), dtype=self.dtype, device=device)

    def copy_prefix(self, src: torch.Tensor, dst: torch.Tensor, n: int) -> None:
        dst.narrow(self.dim, 0, n).copy_(src.narrow(self.dim, 0, n))

    def write(self, t: torch.Tensor, start: int, values: torch.Tensor) -> None:
        t.narrow(self.dim, start, values.shape[self.dim]).copy_(values)

    def read(self, t: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        return t.index_select(self.dim, slots)

    def move(self, t: torch.Tensor, holes: torch.Tensor, movers: torch.Tensor) -> None:
        t.index_copy_(self.dim, holes, t.index_select(self.dim, movers))

    def move_one(self, t: torch.Tensor, hole: int, mover: int) -> None:
        t.narrow(self.dim, hole, 1).copy_(t.narrow(self.dim, mover, 1))

    def live(self, t: torch.Tensor, n: int) -> torch.Tensor:
        return t.narrow(self.dim, 0, n)

    def slot_bytes(self, heads: int) -> int:
        numel = heads
        for x in (*self.pre, *self.post):
            numel *= x
        return numel * torch.empty((), dtype=self.dtype).element_size()


class _BlockedCodes:
    """INT4 key codes in blocks of 64 slots, d-major: ``[heads, capacity/64, D, 32]`` uint8.

    Byte ``j`` of row ``d`` of a block holds slot ``j`` (low nibble) and slot ``j + 32`` (high
    nibble) of that block. This is PyTorch's CPU int4-GEMM weight layout (AVX-512 build) for a
    weight of ``[slots, D]``, so scores ``q @ K^T`` need no unpacking (see fastpath.py). Values
    given and returned are unpacked codes ``[heads, k, D]``.
    """

    dim = 1
    dtype = torch.uint8

    def __init__(self, head_dim: int):
        self.d = head_dim

    def alloc(self, heads: int, cap: int, device) -> torch.Tensor:
        return torch.zeros((heads, cap // BLOCK, self.d, BLOCK // 2), dtype=torch.uint8, device=device)

    def copy_prefix(self, src: torch.Tensor, dst: torch.Tensor, n: int) -> None:
        nb = -(-n // BLOCK)
        dst[:, :nb] = src[:, :nb]

    @staticmethod
    def _where(slots: torch.Tensor):
        blk, i = slots // BLOCK, slots % BLOCK
        return blk, i % (BLOCK // 2), (i >= BLOCK // 2)

    def _index(self, t: torch.Tensor, blk: torch.Tensor, col: torch.Tensor):
        heads = t.shape[0]
        h = torch.arange(heads, device=t.device)[:, None, None]
        d = torch.arange(self.d, device=t.device)[None, None, :]
        return h, blk[None, :, None], d, col[None, :, None]

    def write_slots(self, t: torch.Tensor, slots: torch.Tensor, codes: torch.Tensor) -> None:
        blk, col, high = self._where(slots)
        for sel, shift, keep in ((~high, 0, 0xF0), (high, 4, 0x0F)):  # two slots may share a byte
            if not bool(sel.any()):
                continue
            idx = self._index(t, blk[sel], col[sel])
            t[idx] = (t[idx] & keep) | (codes[:, sel] << shift)

    def write(self, t: torch.Tensor, start: int, codes: torch.Tensor) -> None:
        slots = torch.arange(start, start + codes.shape[1], device=t.device)
        self.write_slots(t, slots, codes)

    def read(self, t: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        blk, col, high = self._where(slots)
        byte = t[self._index(t, blk, col)]
        return torch.where(high[None, :, None], byte >> 4, byte & 0x0F)

    def move(self, t: torch.Tensor, holes: torch.Tensor, movers: torch.Tensor) -> None:
        self.write_slots(t, holes, self.read(t, movers))

    def move_one(self, t: torch.Tensor, hole: int, mover: int) -> None:
        self.move(t, torch.tensor([hole]), torch.tensor([mover]))

    def live(self, t: torch.Tensor, n: int) -> torch.Tensor:
        return t[:, : -(-n // BLOCK)]

    def slot_bytes(self, heads: int) -> int:
        return heads * self.d // 2


class _Tier:
    """Dense storage of ``n`` live token slots over several parts: tail appends, swap-removes,
    capacity doubling and shrinking (capacity a multiple of ``align``)."""

    def __init__(self, parts: dict, heads: int, device, cfg: CacheConfig, stats: CopyStats, align: int = 1):
        self.parts = parts
        self.heads = heads
        self.device = device
        self.cfg = cfg
        self.stats = stats
        self.align = align
        self.n = 0
        self.cap = 0
        self.t: dict[str, torch.Tensor] = {}
        # data pointers of ``t``'s tensors in ``parts`` order (() while unallocated): the native
        # kernels' per-call descriptors read these instead of asking every tensor each step
        self.ptrs: tuple[int, ...] = ()
        self._slot_bytes = sum(p.slot_bytes(heads) for p in parts.values())

    def _round(self, cap: int) -> int:
        return -(-cap // self.align) * self.align

    def _realloc(self, cap: int) -> None:
        cap = self._round(cap)
        new = {k: p.alloc(self.heads, cap, self.device) for k, p in self.parts.items()}
        if self.n:
            for k, p in self.parts.items():
                p.copy_prefix(self.t[k], new[k], self.n)
            self.stats.copied_bytes += self.live_bytes()
        self.stats.reallocs += 1
        self.t, self.cap = new, cap
        self.ptrs = tuple(t.data_ptr() for t in new.values())  # (alloc makes them contiguous)

    def reserve(self, k: int) -> None:
        """Grow the capacity (doubling) so that ``k`` more slots fit.

        A first allocation with ``cfg.headroom`` takes exactly ``k + headroom`` slots instead, so
        that the next ``headroom`` appends copy nothing (doubling an 8k-token BF16 row would copy
        ~100 MB in one decode step).
        """
        if self.n + k > self.cap:
            headroom = getattr(self.cfg, "headroom", 0)
            if self.cap == 0 and headroom:
                self._realloc(max(self.cfg.initial_capacity, k + headroom))
                return
            cap = max(self.cap, self._round(self.cfg.initial_capacity))
            while cap < self.n + k:
                cap *= 2
            self._realloc(cap)

    def commit(self, k: int) -> None:
        """Count ``k`` slots written past ``n`` (after :meth:`reserve`) as live."""
        self.n += k
        self.stats.appended_bytes += k * self._slot_bytes

    def append(self, **values: torch.Tensor) -> None:
        name = next(iter(values))
        k = values[name].shape[self.parts[name].dim]
        self.reserve(k)
        for key, v in values.items():
            self.parts[key].write(self.t[key], self.n, v)
        self.commit(k)

    def take(self, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        return {k: p.read(self.t[k], slots) for k, p in self.parts.items()}

    def remove(self, holes: torch.Tensor, movers: torch.Tensor, new_n: int) -> None:
        if holes.numel():
            for k, p in self.parts.items():
                p.move(self.t[k], holes, movers)
        self.truncate(new_n)

    def truncate(self, new_n: int) -> None:
        """Count only the first ``new_n`` slots as live (no slot moves), then free or shrink as
        :meth:`remove` does."""
        self.n = new_n
        if self.n == 0:
            self.free()
        elif self.cap > self._round(self.cfg.initial_capacity) and self.n < self.cap * self.cfg.shrink_below:
            # Θ(n) removals or appends separate two reallocations: amortised O(1) per token
            self._realloc(max(self.cfg.initial_capacity, (self.n * 5 + 3) // 4))

    def remove_one(self, slot: int) -> None:
        """Swap-remove one slot: the last live slot moves into it."""
        last = self.n - 1
        if slot != last:
            for k, p in self.parts.items():
                p.move_one(self.t[k], slot, last)
        self.truncate(last)

    def compact(self) -> None:
        """Reallocate to the live slots (rounded up to ``align``): returns the spare capacity."""
        if self.n == 0:
            self.free()
        elif self.cap > self._round(self.n):
            self._realloc(self.n)

    def view(self, name: str) -> torch.Tensor:
        """The live part of a plain part's tensor."""
        return self.parts[name].live(self.t[name], self.n)

    def free(self) -> None:
        self.t, self.cap, self.n, self.ptrs = {}, 0, 0, ()

    def slot_bytes(self) -> int:
        """Bytes of one slot (all heads, all parts)."""
        return self._slot_bytes

    def live_bytes(self) -> int:
        return self.n * self._slot_bytes

    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.t.values())


class _Growable:
    """A 1-D int tensor with capacity doubling (index bookkeeping); ``a`` is a NumPy view of the
    same memory, for the one-position reads and writes of a decode step (a tensor's scalar indexing
    costs ~1 µs, a NumPy array's ~0.1 µs)."""

    def __init__(self, dtype: torch.dtype, fill: int = 0):
        self.dtype = dtype
        self.fill = fill
        self.t = torch.empty(0, dtype=dtype)
        self.a = self.t.numpy()

    def ensure(self, size: int) -> None:
        if size > self.t.numel():
            cap = max(64, self.t.numel())
            while cap < size:
                cap *= 2
            new = torch.full((cap,), self.fill, dtype=self.dtype)
            new[: self.t.numel()] = self.t
            self.t = new
            self.a = new.numpy()

    def nbytes(self) -> int:
        return self.t.numel() * self.t.element_size()


class _GroupIndex:
    """Per (sequence, layer group): tier and slot of every position, position of every slot, counts."""

    def __init__(self) -> None:
        self.length = 0
        self.prompt_len = 0
        self.tier_of = _Growable(torch.int8, fill=-1)
        self.slot_of = _Growable(torch.int32)
        self.pos_of = {t: _Growable(torch.int32) for t in TIERS}
        self.n = dict.fromkeys(TIERS, 0)
        # counts[tier] = [prompt tokens, generated tokens]
        self.counts = {t: [0, 0] for t in (*TIERS, R)}
        # KVFetch's cold tier: the cold slot of every position (-1: none), its count, and the
        # positions fetched back into H (they stay in the cold tier too)
        self.cold_slot = _Growable(torch.int32, fill=-1)
        self.cold_n = 0
        self.cold_counts = [0, 0]
        self.fetched: set[int] = set()

    def positions(self, tier: int) -> torch.Tensor:
        return self.pos_of[tier].t[: self.n[tier]]

    def _count(self, tier: int, pos: torch.Tensor, sign: int) -> None:
        dec = int((pos >= self.prompt_len).sum())
        self.counts[tier][0] += sign * (pos.numel() - dec)
        self.counts[tier][1] += sign * dec

    def append_h(self, k: int) -> None:
        start = self.length
        self.length += k
        self.tier_of.ensure(self.length)
        self.slot_of.ensure(self.length)
        if self.cold_n:
            self.cold_slot.ensure(self.length)
        if k == 1:  # a decode step: no tensor ops
            return self.add_one(H, start)
        self._add(H, torch.arange(start, start + k, dtype=torch.int32))

    def _add(self, tier: int, pos: torch.Tensor) -> None:
        n = self.n[tier]
        k = pos.numel()
        self.pos_of[tier].ensure(n + k)
        self.pos_of[tier].t[n : n + k] = pos
        self.tier_of.t[pos.long()] = tier
        self.slot_of.t[pos.long()] = torch.arange(n, n + k, dtype=torch.int32)
        self.n[tier] = n + k
        self._count(tier, pos, +1)

    def plan_remove(self, tier: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Holes below the new end, and the tail slots that move into them."""
        n = self.n[tier]
        new_n = n - slots.numel()
        tail = torch.arange(new_n, n, dtype=torch.long)
        movers = tail[~torch.isin(tail, slots)]
        holes = torch.sort(slots[slots < new_n]).values
        return holes, movers, new_n

    def remove(self, tier: int, pos: torch.Tensor, plan: tuple[torch.Tensor, torch.Tensor, int]) -> None:
        holes, movers, new_n = plan
        p = self.pos_of[tier].t
        if holes.numel():
            moved = p[movers].clone()
            p[holes] = moved
            self.slot_of.t[moved.long()] = holes.to(torch.int32)
        self.n[tier] = new_n
        self._count(tier, pos, -1)

    def release(self, pos: torch.Tensor) -> None:
        self.tier_of.t[pos.long()] = R
        self._count(R, pos, +1)

    def unrelease(self, pos: torch.Tensor) -> None:
        """Count released positions out of R (a fetch brings them back into a tier)."""
        self._count(R, pos, -1)

    def add_cold(self, pos: torch.Tensor) -> None:
        """Give ``pos`` the next cold slots (in order)."""
        k = pos.numel()
        self.cold_slot.ensure(self.length)
        self.cold_slot.t[pos.long()] = torch.arange(self.cold_n, self.cold_n + k, dtype=torch.int32)
        self.cold_n += k
        dec = int((pos >= self.prompt_len).sum())
        self.cold_counts[0] += k - dec
        self.cold_counts[1] += dec

    # one position at a time (a decode step): plain ints, no tensor ops per call
    def remove_one(self, tier: int, pos: int) -> tuple[int, int]:
        """Swap-remove ``pos`` from ``tier``; returns (its slot, the last slot that moved into it)."""
        slot, last = int(self.slot_of.a[pos]), self.n[tier] - 1
        if slot != last:
            po = self.pos_of[tier].a
            moved = int(po[last])
            po[slot] = moved
            self.slot_of.a[moved] = slot
        self.n[tier] = last
        self.counts[tier][int(pos >= self.prompt_len)] -= 1
        return slot, last

    def add_one(self, tier: int, pos: int) -> None:
        n = self.n[tier]
        self.pos_of[tier].ensure(n + 1)
        self.pos_of[tier].a[n] = pos
        self.tier_of.a[pos] = tier
        self.slot_of.a[pos] = n
        self.n[tier] = n + 1
        self.counts[tier][int(pos >= self.prompt_len)] += 1

    def release_one(self, pos: int) -> None:
        self.tier_of.a[pos] = R
        self.counts[R][int(pos >= self.prompt_len)] += 1

    def nbytes(self) -> int:
        held = self.tier_of.nbytes() + self.slot_of.nbytes() + self.cold_slot.nbytes()
        return held + sum(g.nbytes() for g in self.pos_of.values())


def key_balance(keys: torch.Tensor, native: bool = True) -> torch.Tensor:
    """Per-channel key balance ``[Hkv, 2, D]`` fp32 of ``keys [Hkv, n, D]``: mid-range, sqrt of the range.

    Keys have outlier channels (Qwen2's k-bias puts a large offset on a few channels): quantised
    per token, a group's scale follows its outlier and flattens every other channel. Centring each
    channel on its mid-range and dividing by the square root of its range before the per-token
    quantisation cuts the attention-output error of an all-INT4 replay on qwen2.5-coder-0.5b from
    0.50 to 0.09 (mean over layers; layer 0: 1.08 -> 0.14; ``benchmarks/results/key_balance.md``).
    In the spirit of KIVI's per-channel keys and MiKV's outlier balancing, kept per token so that
    every token can still get its own action. ``native``: take the per-channel range from the native
    kernel where it applies (the same values, without an fp32 copy of the keys).
    """
    from pask.kv import native_attention  # (imports this module)

    got = native_attention.key_range(keys) if native else None
    if got is None:
        k = keys.float()
        got = k.amax(dim=1), k.amin(dim=1)
    hi, lo = got
    return torch.stack([(hi + lo) / 2, (hi - lo).clamp_min(1e-4).sqrt()], dim=1)


def _latent_parts(latent: LatentTier, heads: int) -> dict:
    """A latent tier's storage parts (:meth:`~pask.kv.latent.LatentTier.part_shapes`) as plain parts."""
    return {name: _Plain((), shape, dtype) for name, (shape, dtype) in latent.part_shapes(heads).items()}


class _SeqStore:
    """One sequence's tiers in one layer.

    H tier: ``k, v [Hkv, cap, D]`` (model dtype). L tier (INT4): ``kq`` key codes (blocked,
    d-major), ``ksz [Hkv, D/g, cap, 2]`` (scale, zero) per key group with
    ``k' = (code - 8) * scale + zero`` (the int4 GEMM's convention), ``vq [Hkv, D/g, cap, g/2]`` value
    codes per group as adjacent pairs (the GEMM's layout for a ``[g, tokens]`` weight), ``vs, vz
    [Hkv, D/g, cap]`` value scale and zero. L2 tier (INT2): ``kq [Hkv, cap, D/4]`` (four codes per
    byte, :func:`~pask.kv.quant.pack_quads`, ``k' = (code - 2) * scale + zero``) and
    ``vq [Hkv, D/g, cap, g/4]``; scales and zeros as at 4 bits. With ``CacheConfig.l2_key_bits = 4``
    (K4V2) the L2 tier keeps its keys at INT4 instead, in the L tier's blocked layout (``k' = (code -
    8) * scale + zero``, scored by the INT4 stream's path), values still INT2.
    A tier allocates nothing until its first token. Scales and zeros are bf16 (same 2 bytes as fp16;
    the int4 GEMM reads bf16), rounded so the round-trip error stays within ``scale / 2``. Keys are balanced per channel
    before quantisation (:func:`key_balance`): the codes hold ``k' = (k - mid) / bal`` and
    ``k = k' * bal + mid``, with ``kbal [Hkv, 2, D]`` (fp32, counted in the held bytes) shared by
    both low tiers and fixed at the first low-bit write from the keys the H tier then holds (at
    prefill: the whole prompt).
    """

    def __init__(
        self,
        heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device,
        cfg: CacheConfig,
        stats: CopyStats,
        latent: LatentTier | None = None,
    ):
        g = head_dim // cfg.quant_group
        self.group = cfg.quant_group
        kv = {"k": _Plain((), (head_dim,), dtype), "v": _Plain((), (head_dim,), dtype)}
        self._kv_slot_bytes = sum(p.slot_bytes(heads) for p in kv.values())
        # a latent source layer (pask.kv.latent): its H slots also hold each token's latent
        self.latent = latent
        captured = latent is not None and latent.captures
        self.h = _Tier({**kv, **_latent_parts(latent, heads)} if captured else kv, heads, device, cfg, stats)

        def low(bits: int, kbits: int) -> _Tier:
            per_byte = 8 // bits
            parts = {  # INT4 keys (the L tier's, K4V2's) blocked; INT2 keys token-major
                "kq": _BlockedCodes(head_dim) if kbits == 4 else _Plain((), (head_dim // 4,), torch.uint8),
                "ksz": _Plain((g,), (2,), SCALE_DTYPE),
                "vq": _Plain((g,), (cfg.quant_group // per_byte,), torch.uint8),
                "vs": _Plain((g,), (), SCALE_DTYPE),
                "vz": _Plain((g,), (), SCALE_DTYPE),
            }
            return _Tier(parts, heads, device, cfg, stats, align=BLOCK if kbits == 4 else 1)

        self.l2_kbits = check_bits(getattr(cfg, "l2_key_bits", 2))  # K4V2 when 4
        # the L tier of a latent source layer holds latents (the block's L tokens), else INT4 K/V
        self.l = _Tier(_latent_parts(latent, heads), heads, device, cfg, stats) if latent else low(4, 4)
        self.l2 = low(2, self.l2_kbits)
        self._low_tier = low
        self.cold: _Tier | None = None  # KVFetch's cold tier (created on the first demotion)
        self.cold_bits = check_bits(getattr(cfg, "cold_bits", 2))
        self.kbal: torch.Tensor | None = None  # [Hkv, 2, D] fp32: per-channel mid-range, sqrt(range)
        self.balanced = getattr(cfg, "key_balance", True)
        self.native = getattr(cfg, "native", True)  # bulk low-bit writes by the native kernel where they apply

    def tier(self, t: int) -> _Tier:
        """The tier of tier code ``t`` (an :class:`Action` value other than R)."""
        return self.h if t == H else self.l if t == L else self.l2

    def low(self, bits: int) -> _Tier:
        """The low-bit tier of ``bits`` (4: L, 2: L2); KVCacheError for another width."""
        if bits == 4:  # (the decode step's moves ask per store: no validation call for INT4)
            return self.l
        check_bits(bits)  # KVCacheError for a width other than 2 and 4
        return self.l2

    def key_bits(self, bits: int) -> int:
        """Key code width of the ``bits`` tier: 4 for L; 2 for L2, or 4 where the cache stores K4V2
        (``CacheConfig.l2_key_bits``: INT4 keys in the L tier's blocked layout, INT2 values)."""
        return 4 if check_bits(bits) == 4 else self.l2_kbits

    def tiers(self) -> tuple[_Tier, _Tier, _Tier]:
        """H, L, L2: the tiers attention reads."""
        return self.h, self.l, self.l2

    def all_tiers(self) -> tuple[_Tier, ...]:
        """Every tier that holds bytes: H, L, L2 and the cold tier once it exists."""
        return self.tiers() if self.cold is None else (*self.tiers(), self.cold)

    def cold_tier(self) -> _Tier:
        """The cold tier (``cold_bits`` codes in the layout of the low tier of that width), created on first use."""
        if self.cold is None:
            self.cold = self._low_tier(self.cold_bits, self.key_bits(self.cold_bits))
        return self.cold

    def ensure_balance(self, k: torch.Tensor) -> None:
        """Fix the key balance at the first low-bit write (from the H tier's keys, else ``k``)."""
        if self.kbal is not None:
            return
        self.kbal = key_balance(self.h.view("k") if self.h.n else k, native=self.native)
        if not self.balanced:  # plain per-token quantisation (ablation): identity balance, not stored
            self.kbal = torch.stack([torch.zeros_like(self.kbal[:, 0]), torch.ones_like(self.kbal[:, 1])], 1)

    def append_low(self, k: torch.Tensor, v: torch.Tensor, bits: int = 4) -> None:
        """Quantise ``k, v [Hkv, n, D]`` (keys balanced per channel) to ``bits`` and append them to that tier."""
        self.ensure_balance(k)
        if self.native and k.shape[1] > 1:
            from pask.kv import native_attention  # (imports this module)

            if native_attention.quantize_low(self, k, v, bits):
                return
        self.low(bits).append(**self._quantize(k, v, bits))

    def append_low_from_h(self, slots: torch.Tensor, bits: int = 4) -> None:
        """:meth:`append_low` of the H tier's ``slots`` (int64), read in place by the native
        quantiser where it applies (else gathered first); the H tier is left as it is."""
        if self.native and slots.numel() > 1 and self.h.n:
            from pask.kv import native_attention  # (imports this module)

            self.ensure_balance(self.h.view("k"))
            if native_attention.quantize_low(self, self.h.t["k"], self.h.t["v"], bits, slots=slots):
                return
        kv = self.h.take(slots)
        self.append_low(kv["k"], kv["v"], bits)

    def append_cold(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantise ``k, v [Hkv, n, D]`` to ``cold_bits`` (as :meth:`append_low`) into the cold tier."""
        self.ensure_balance(k)
        self.cold_tier().append(**self._quantize(k, v, self.cold_bits))

    def _quantize(self, k: torch.Tensor, v: torch.Tensor, bits: int) -> dict[str, torch.Tensor]:
        """The parts of a ``bits`` tier holding ``k, v [Hkv, n, D]`` (keys balanced per channel)."""
        mid, bal = self.kbal[:, 0:1], self.kbal[:, 1:2]
        b = check_bits(bits)
        kb = self.key_bits(b)
        kc, ks, kz = quantize_codes((k.float() - mid) / bal, self.group, key_zero_point(kb), SCALE_DTYPE, kb)
        vc, vs, vz = quantize_codes(v, self.group, 0, SCALE_DTYPE, b)
        ksz = torch.stack([ks, kz], dim=-1).transpose(1, 2)
        heads, n, d = vc.shape
        pack = pack_pairs if b == 4 else pack_quads
        vq = pack(vc.view(heads, n, d // self.group, self.group)).transpose(1, 2)
        kq = kc if kb == 4 else pack_quads(kc)  # INT4 key parts take unpacked codes (blocked layout)
        return {"kq": kq, "ksz": ksz, "vq": vq, "vs": vs.transpose(1, 2), "vz": vz.transpose(1, 2)}

    def low_kv(
        self,
        start: int = 0,
        stop: int | None = None,
        dtype=torch.float32,
        bits: int = 4,
        slots: torch.Tensor | None = None,
        cold: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantised keys and values ``[Hkv, m, D]`` of the ``bits`` tier's slots ``[start, stop)``
        (or of ``slots``, a LongTensor, when given); ``cold``: of the cold tier (``bits`` ignored)."""
        if cold:
            bits = self.cold_bits
        lt = self.cold_tier() if cold else self.low(bits)
        if slots is None:
            stop = lt.n if stop is None else stop
            slots = torch.arange(start, stop, device=lt.device)
        t = lt.t
        kb = self.key_bits(bits)
        kq = t["kq"]
        codes = lt.parts["kq"].read(kq, slots) if kb == 4 else unpack_quads(kq.index_select(1, slots))
        sz = t["ksz"].index_select(2, slots).float().transpose(1, 2)  # [Hkv, m, G, 2]
        k = dequantize_codes(codes, sz[..., 0], sz[..., 1], torch.float32, zero_point=key_zero_point(kb))
        k = (k * self.kbal[:, 1:2] + self.kbal[:, 0:1]).to(dtype)
        vs = t["vs"].index_select(2, slots).transpose(1, 2)
        vz = t["vz"].index_select(2, slots).transpose(1, 2)
        unpack = unpack_pairs if bits == 4 else unpack_quads
        vc = unpack(t["vq"].index_select(2, slots)).transpose(1, 2).flatten(-2)  # [Hkv, m, D]
        v = dequantize_codes(vc, vs, vz, dtype)
        return k, v

    def kv_slot_bytes(self) -> int:
        """Bytes of one token's exact K and V in this layer (the Full-KV reference; a latent source
        layer's H slots hold its latent on top)."""
        return self._kv_slot_bytes

    def append_latent(self, z: torch.Tensor) -> None:
        """Append latents ``[n, hidden]`` (encoded at the tier's width) to this source layer's L tier."""
        self.l.append(**self.latent.encode(z, self.h.heads))

    def latent_view(self, start: int, stop: int, dtype=torch.float32) -> torch.Tensor:
        """Decoded latents ``[stop - start, hidden]`` of L slots ``[start, stop)`` (a latent source layer)."""
        return self.latent.decode({k: t.narrow(1, start, stop - start) for k, t in self.l.t.items()}, dtype)

    def balance_bytes(self) -> int:
        """Bytes of the key balance vectors (0 before the first low-bit write)."""
        if self.kbal is None or not self.balanced:
            return 0
        return self.kbal.numel() * self.kbal.element_size()

    def live_bytes(self) -> int:
        """Bytes of the live slots of every tier and the key balance."""
        return sum(t.live_bytes() for t in self.all_tiers()) + self.balance_bytes()

    def allocated_bytes(self) -> int:
        """Bytes of every tier tensor (spare capacity included) and the key balance."""
        return sum(t.allocated_bytes() for t in self.all_tiers()) + self.balance_bytes()
