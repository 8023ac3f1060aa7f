"""TieredCache: a transformers ``Cache`` holding each token's K/V as BF16 (H), INT4 (L), INT2 (L2) or nothing (R).

Storage (per layer, per sequence, no padding held; see :mod:`pask.kv.storage`):

* H tier: dense ``K, V [Hkv, capacity, D]`` in the model dtype;
* L tier: INT4 codes (two per byte, keys in 64-slot d-major blocks, values per scale group as
  adjacent pairs: the layouts PyTorch's CPU int4 GEMM reads) + per (token, group) scale and zero;
* L2 tier: INT2 codes (four per byte, token-major) + per (token, group) scale and zero, read by the
  native decode kernel and the reference attention (the fused and Triton kernels serve H + INT4
  only, and step aside for a sequence holding INT2 tokens).

Any token of any layer group may sit in any tier: one cache holds all three at once. A token only
moves down the harm chain H -> L -> L2 -> R (:data:`pask.kv.actions.HARM_ORDER`); an INT4 token
moved to INT2 is requantised from its dequantised INT4 values.

KVFetch's cold tier (:meth:`TieredCache.recall`, :class:`~pask.kv.actions.ColdOp`) sits beside
them: low-bit copies (``CacheConfig.cold_bits``) of tokens released from attention, never read by
attention, counted in the held bytes. A fetch dequantises a cold token into the H tier (the one move
up the chain, only for a token with a cold copy); an unfetch releases it again.

Each tier is dense: slots ``[0, n)`` are live. Appends write at the tail and double the
capacity when full (amortised O(1) per token); removals move the last live slots into the
holes ("swap-remove", O(removed) copies) so no hole is ever held, and a tier whose live part
falls under ``shrink_below`` of its capacity is reallocated smaller, which returns the memory.
Order inside a tier does not matter to attention (RoPE is already applied to the stored keys);
the original position of every slot is kept in a per (sequence, layer group) index shared by
the layers of the group (all of them receive the same actions, so their slots agree).

Logical positions: ``seq_length(b)`` counts the tokens ever appended to sequence ``b`` (its next
RoPE position); released tokens keep their position. Decoding must pass explicit
``position_ids`` ([B, 1] = ``seq_length(b)``) since rows have different lengths.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from pask.cpu.bf16_matmul import row_bucket
from pask.kv import native_attention
from pask.kv.actions import LOW_BITS, Action, ColdOp, harm
from pask.kv.budget import BudgetMeter
from pask.kv.config import CacheConfig
from pask.kv.errors import (
    AlreadyReleasedError,
    IrreversibleActionError,
    KVCacheError,
    ProtectedTokenError,
    UnknownPositionError,
    UnsupportedModelError,
)
from pask.kv.latent import normed_input
from pask.kv.quant import check_group
from pask.kv.storage import CopyStats, _GroupIndex, _SeqStore

H, L, R, L2 = int(Action.H), int(Action.L), int(Action.R), int(Action.L2)


@dataclass(frozen=True)
class AttentionSpec:
    """The attention shapes the cache stores."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int


def attention_spec(model_config, quant_group: int = 32) -> AttentionSpec:
    """Read and validate the attention layout of a decoder config (raise UnsupportedModelError)."""
    cfg = model_config.get_text_config(decoder=True) if hasattr(model_config, "get_text_config") else model_config
    name = getattr(cfg, "model_type", type(cfg).__name__)
    missing = [a for a in ("num_hidden_layers", "num_attention_heads", "hidden_size") if getattr(cfg, a, None) is None]
    if missing:
        raise UnsupportedModelError(f"model '{name}' has no {', '.join(missing)} in its config: unsupported layout")
    if getattr(cfg, "kv_lora_rank", None) or getattr(cfg, "q_lora_rank", None):
        raise UnsupportedModelError(f"model '{name}' uses latent (MLA) attention: unsupported layout")
    n_q = int(cfg.num_attention_heads)
    n_kv = getattr(cfg, "num_key_value_heads", None)
    if n_kv is None:
        raise UnsupportedModelError(
            f"model '{name}' config has no num_key_value_heads: only Llama/Qwen2-style (GQA/MHA) attention is supported"
        )
    n_kv = int(n_kv)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_q
    if n_kv < 1 or n_q % n_kv:
        raise UnsupportedModelError(f"model '{name}': {n_q} query heads are not a multiple of {n_kv} kv heads")
    types = getattr(cfg, "layer_types", None) or []
    other = sorted({t for t in types if t != "full_attention"})
    if other:
        raise UnsupportedModelError(f"model '{name}' has {other} layers: only full-attention layers are supported")
    check_group(int(head_dim), quant_group)
    return AttentionSpec(int(cfg.num_hidden_layers), n_q, n_kv, int(head_dim))


def attention_config(kv_heads: int, rows: int, head_dim: int, layers: int = 1):
    """A minimal Llama config with this attention layout (``rows`` query heads per kv head), for
    caches built without a model: the native kernel's probe, tests and benchmarks."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=kv_heads * rows * head_dim,
        num_attention_heads=kv_heads * rows,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        num_hidden_layers=layers,
        intermediate_size=8,
        vocab_size=8,
    )


def layer_groups(num_layers: int, num_groups: int = 4) -> list[range]:
    """Split ``num_layers`` into ``num_groups`` contiguous, near-equal groups (earlier groups one larger)."""
    if not 1 <= num_groups <= num_layers:
        raise KVCacheError(f"cannot split {num_layers} layers into {num_groups} groups")
    base, extra = divmod(num_layers, num_groups)
    out, start = [], 0
    for g in range(num_groups):
        size = base + (1 if g < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


_ACTIVE = threading.local()


def active_layer(key: torch.Tensor) -> TieredLayer | None:
    """The TieredLayer whose ``update`` returned ``key`` in this thread (None if ``key`` is not one).

    Weak references: a finished cache is never kept alive by this record.
    """
    entry = getattr(_ACTIVE, "entry", None)
    if entry is None or entry[1]() is not key:
        return None
    return entry[0]()


_TIER_NAMES = {H: "BF16", L: "INT4", L2: "INT2", R: "released"}


class TieredLayer(CacheLayerMixin):
    """One model layer of a :class:`TieredCache`: per-sequence H, L and L2 tiers."""

    is_sliding = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, cache: TieredCache, layer_idx: int, group: int):
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.group = group
        self.seqs: list[_SeqStore | None] = []
        self.dtype: torch.dtype | None = None
        self.device = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        c = self.cache
        self.seqs = [None if c.dropped[b] else self.new_store() for b in range(c.num_seqs)]
        self.is_initialized = True

    @property
    def latent_source(self) -> bool:
        """This layer is its block's latent source (a latent cache): its stores hold the block's latents."""
        lat = self.cache.config.latent
        return lat is not None and self.layer_idx == lat.sources[self.group]

    def new_store(self) -> _SeqStore:
        c = self.cache
        lat = c.config.latent if self.latent_source else None
        return _SeqStore(c.spec.num_kv_heads, c.spec.head_dim, self.dtype, self.device, c.config, c.stats, lat)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store the new tokens of every live row in its H tier; return the new K/V unchanged."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        c = self.cache
        if key_states.shape[0] != c.num_seqs:
            raise KVCacheError(f"batch of {key_states.shape[0]} rows fed to a TieredCache of {c.num_seqs} sequences")
        prefill = c.mode == "prefill"
        lat = c.config.latent
        if (
            not prefill
            and lat is None
            and c.config.native
            and native_attention.append_h(self.seqs, key_states, value_states)
        ):
            return key_states, value_states
        z = normed_input(self.layer_idx, *key_states.shape[::2]) if self.latent_source and lat.captures else None
        for b, store in enumerate(self.seqs):
            if store is None:
                continue
            start = c.pad_lengths[b] if prefill else 0
            extra = lat.encode(z[b, start:], store.h.heads) if z is not None else {}
            store.h.append(k=key_states[b, :, start:], v=value_states[b, :, start:], **extra)
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.cache.get_seq_length()

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise KVCacheError("TieredCache cannot be reset: create a new one")

    def crop(self, tokens_to_remove: int) -> None:
        raise KVCacheError("TieredCache cannot be cropped")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise KVCacheError("TieredCache does not support beam reordering")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise KVCacheError("TieredCache does not support batch expansion")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise KVCacheError("TieredCache does not support batch selection: use drop(seq)")

    def offload(self) -> None:
        pass

    def prefetch(self) -> None:
        pass

    # -- views used by the attention ---------------------------------------------------------
    def store(self, seq: int) -> _SeqStore | None:
        return self.seqs[seq]

    def positions(self, seq: int, tier: Action) -> torch.Tensor:
        """Original positions of the tokens in ``tier`` (slot order) for this layer's group."""
        return self.cache.index(seq, self.group).positions(int(tier))


@dataclass
class _Move:
    """A single-position H -> INT4 / INT2 move prepared by :meth:`TieredCache._prepare_one`: the H
    side's bookkeeping is done and the low tiers have room; :meth:`TieredCache._finish_moves` runs it."""

    stores: list[_SeqStore]  # the layers of the group
    slot: int  # the token's H slot (H slot ``last`` moves into it)
    last: int
    lslot: int  # its slot in the low tier
    bits: int
    ix: _GroupIndex
    target: int  # the tier it joins (L or L2)
    p: int  # its position


@dataclass
class _Finished:
    held: list[int] = field(default_factory=lambda: [0, 0])  # prompt, decode
    full: list[int] = field(default_factory=lambda: [0, 0])


class TieredCache(Cache):
    """A transformers Cache of :class:`TieredLayer`; see the module docstring."""

    def __init__(self, model_config, config: CacheConfig | None = None, batch_size: int = 1):
        self.config = config or CacheConfig()
        self._model_config = model_config
        self.spec = attention_spec(model_config, self.config.quant_group)
        if batch_size < 0:
            raise KVCacheError(f"batch_size must be >= 0, got {batch_size}")
        self.num_seqs = batch_size
        lat = self.config.latent
        n_layers = self.spec.num_layers
        self.groups = list(lat.groups) if lat is not None else layer_groups(n_layers, self.config.num_groups)
        self.group_of = [g for g, r in enumerate(self.groups) for _ in r]
        self.stats = CopyStats()
        self.dropped = [False] * batch_size
        self.pad_lengths = [0] * batch_size
        self.mode = "empty"  # empty -> prefill (first forward) -> extend
        self._indices = [[_GroupIndex() for _ in self.groups] for _ in range(batch_size)]
        self._finished = _Finished()
        self.meter = BudgetMeter()
        self._scratch: dict = {}  # a latent cache's decoded block (latent_rows, latent_key_rows)
        super().__init__(layers=[TieredLayer(self, i, self.group_of[i]) for i in range(self.spec.num_layers)])

    @property
    def batch_size(self) -> int:
        return self.num_seqs

    # -- lengths ------------------------------------------------------------------------------
    def seq_length(self, seq: int) -> int:
        """Tokens ever appended to ``seq`` (its next RoPE position)."""
        return self._indices[seq][0].length

    def prompt_length(self, seq: int) -> int:
        return self._indices[seq][0].prompt_len

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Logical length: the longest sequence's token count (= all rows' count in a batch of one)."""
        return max((ix[0].length for ix in self._indices), default=0)

    def index(self, seq: int, group: int) -> _GroupIndex:
        self._check_seq(seq)
        if not 0 <= group < len(self.groups):
            raise UnknownPositionError(f"unknown layer group {group}: the cache has {len(self.groups)} groups")
        return self._indices[seq][group]

    def _check_seq(self, seq: int) -> None:
        if not 0 <= seq < self.num_seqs:
            raise UnknownPositionError(f"unknown sequence {seq}: the cache holds {self.num_seqs}")
        if self.dropped[seq]:
            raise UnknownPositionError(f"sequence {seq} was dropped")

    # -- forward ------------------------------------------------------------------------------
    def begin_prefill(self, pad_lengths: list[int]) -> None:
        """Declare the left padding of each row of the coming first forward (pads are not stored)."""
        if self.mode != "empty":
            raise KVCacheError("begin_prefill must be called once, before the first forward")
        if len(pad_lengths) != self.num_seqs or any(p < 0 for p in pad_lengths):
            raise KVCacheError(f"pad_lengths must hold {self.num_seqs} non-negative ints, got {pad_lengths}")
        self.pad_lengths = [int(p) for p in pad_lengths]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if layer_idx == 0:
            self._start_forward(key_states.shape[2])
        if layer_idx in (r.start for r in self.groups):
            self._scratch.clear()  # the previous block's decoded latents (a latent cache)
            g = self.group_of[layer_idx]
            q = key_states.shape[2]
            for b in range(self.num_seqs):
                if not self.dropped[b]:
                    pad = self.pad_lengths[b] if self.mode == "prefill" else 0
                    self._indices[b][g].append_h(q - pad)
        keys, values = self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)
        _ACTIVE.entry = (weakref.ref(self.layers[layer_idx]), weakref.ref(keys))
        return keys, values

    def _start_forward(self, q_len: int) -> None:
        if self.mode == "empty":
            self.mode = "prefill"
            for b in range(self.num_seqs):
                if self.pad_lengths[b] > q_len:
                    raise KVCacheError(f"row {b} has {self.pad_lengths[b]} pads but the prefill has {q_len} columns")
                for ix in self._indices[b]:
                    ix.prompt_len = q_len - self.pad_lengths[b]
        else:
            self.mode = "extend"

    def latent_block(self, seq: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A latent cache's L tokens of ``seq`` in ``group`` for this forward: decoded latents ``[m,
        hidden]`` (model dtype) and their RoPE ``cos, sin [m, D]`` (fp32): views of
        :meth:`latent_rows`."""
        z, cos, sin, spans = self.latent_rows(group)
        a, e = spans.get(seq, (0, 0))
        return z[a:e], cos[a:e], sin[a:e]

    def latent_padded(self, seq: int, group: int) -> torch.Tensor:
        """:meth:`latent_block`'s latents of ``seq`` followed by other rows' latents or zeros up to
        :func:`~pask.cpu.bf16_matmul.row_bucket` of their count: a GEMM over them (zero weights on the
        extra rows) sees a bounded set of shapes (:data:`~pask.cpu.bf16_matmul.ROW_BUCKETS`)."""
        a, e = self.latent_rows(group)[3].get(seq, (0, 0))
        return self._scratch[("buffer", group)][a : a + row_bucket(e - a)]

    def latent_rows(self, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[int, tuple[int, int]]]:
        """The L tokens of every live row in ``group`` for this forward, rows one after another:
        decoded latents ``[M, hidden]`` (model dtype), RoPE ``cos, sin [M, D]`` (fp32) and each
        row's ``(start, stop)``. Computed once for the block's layers, so that each layer rebuilds
        the keys of all rows in one product; freed when the next block starts (a transient, not
        held bytes). The latents sit in a buffer with zero rows after them, so that the block's
        GEMMs can run over bucketed row counts (:meth:`latent_key_rows`, :meth:`latent_padded`)."""
        hit = self._scratch.get(group)
        if hit is None:
            lat = self.config.latent
            zs, pos, spans, at = [], [], {}, 0
            for b in range(self.num_seqs):
                if self.dropped[b]:
                    continue
                src = self.layers[lat.sources[group]].seqs[b]
                if src is None or not src.l.n:
                    continue
                zs.append(src.latent_view(0, src.l.n, lat.dtype))
                pos.append(self.index(b, group).positions(L))
                spans[b] = (at, at + src.l.n)
                at += src.l.n
            tail = max([row_bucket(at) - at, *(row_bucket(e - a) - (e - a) for a, e in spans.values())])
            buf = torch.empty(at + tail, lat.hidden, dtype=lat.dtype)
            if zs:
                torch.cat(zs, out=buf[:at])
            buf[at:].zero_()
            self._scratch[("buffer", group)] = buf
            if zs:
                hit = (buf[:at], *lat.rope(torch.cat(pos)), spans)
            else:
                hit = (buf[:0], torch.empty(0, lat.head_dim), torch.empty(0, lat.head_dim), spans)
            self._scratch[group] = hit
        return hit

    def latent_key_rows(self, group: int) -> torch.Tensor:
        """The part of :meth:`latent_rows`' latents that keys are rebuilt from, contiguous, with zero
        rows up to :func:`~pask.cpu.bf16_matmul.row_bucket` of their count (a bounded set of GEMM shapes:
        slice the product's rows to the latents'): a split latent's first ``key_dim`` values (copied
        once for the block's layers), else the latents."""
        lat = self.config.latent
        m = self.latent_rows(group)[0].shape[0]
        buf = self._scratch[("buffer", group)][: row_bucket(m)]
        if lat.key_dim is None:
            return buf
        hit = self._scratch.get(("keys", group))
        if hit is None:
            hit = self._scratch[("keys", group)] = lat.key_part(buf).contiguous()
        return hit

    # -- actions ------------------------------------------------------------------------------
    def apply(self, seq: int, group: int, positions, action: Action) -> None:
        """Apply ``action`` to ``positions`` of sequence ``seq`` in every layer of ``group``.

        H keeps (no-op on H tokens), L packs H tokens to INT4 (no-op on L tokens), L2 packs H tokens
        to INT2 and requantises L tokens to INT2 (no-op on L2 tokens), R frees tokens of any tier.
        Raises on unknown/duplicate positions, released tokens, a move up the harm chain (L -> H,
        L2 -> L or H) and the protected recent window.
        """
        action = Action(int(action))
        ix = self.index(seq, group)
        self._scratch.clear()  # a latent cache's decoded block is stale once its tiers change
        if action == Action.L2 and self.config.latent is not None:
            raise KVCacheError("a latent cache has no INT2 tier: its L action keeps the block's latent")
        pos = torch.as_tensor(positions, dtype=torch.long).reshape(-1)
        if pos.numel() == 0:
            return
        if pos.numel() == 1:  # a decode step's token leaving the window: the scalar path
            return self._apply_one(seq, group, ix, int(pos[0]), action)
        self._check_known(seq, ix, pos, "action")
        tiers = ix.tier_of.t[pos].long()
        self._check_held(seq, group, ix, pos, tiers)
        if ix.fetched:
            self._check_fetched(seq, group, ix, pos, action)
        above = [t for t in (L, L2) if harm(t) > harm(action)]
        bad = torch.isin(tiers, torch.tensor(above, dtype=torch.long)) if above else None
        if bad is not None and bool(bad.any()):
            raise self._irreversible(seq, group, pos[bad][:5].tolist(), int(tiers[bad][0]), action)
        if action == Action.H:
            return
        layers = [self.layers[i] for i in self.groups[group]]
        from_h = pos[tiers == H]
        if action == Action.L:
            self._move_to_low(seq, ix, layers, from_h, H, 4)
        elif action == Action.L2:
            self._move_to_low(seq, ix, layers, from_h, H, 2)
            self._move_to_low(seq, ix, layers, pos[tiers == L], L, 2)
        else:
            self._release_held(seq, ix, layers, pos, tiers)

    def _check_known(self, seq: int, ix: _GroupIndex, pos: torch.Tensor, what: str) -> None:
        """UnknownPositionError for a position the sequence does not have, or one given twice."""
        if int(pos.min()) < 0 or int(pos.max()) >= ix.length:
            raise self._unknown(seq, ix, pos[(pos < 0) | (pos >= ix.length)][:5].tolist())
        if torch.unique(pos).numel() != pos.numel():
            raise UnknownPositionError(f"duplicate positions in one {what} for sequence {seq}")

    def _check_held(self, seq: int, group: int, ix: _GroupIndex, pos: torch.Tensor, tiers: torch.Tensor) -> None:
        """Errors for positions inside the protected recent window, or already released."""
        limit = ix.length - self.config.recent_window
        if int(pos.max()) >= limit:
            raise self._protected(seq, ix, pos[pos >= limit][:5].tolist())
        if bool((tiers == R).any()):
            raise self._released(seq, group, pos[tiers == R][:5].tolist())

    def _release_held(
        self, seq: int, ix: _GroupIndex, layers: list[TieredLayer], pos: torch.Tensor, tiers: torch.Tensor
    ) -> None:
        """Free the held tokens at ``pos`` (``tiers``: their tier) in every layer of the group."""
        for tier in (H, L, L2):
            sel = pos[tiers == tier]
            if sel.numel():
                self._remove(seq, ix, layers, tier, sel)
                ix.release(sel)

    # the errors of apply (one text for the batch and the one-position path)
    @staticmethod
    def _unknown(seq: int, ix: _GroupIndex, bad: list[int]) -> UnknownPositionError:
        return UnknownPositionError(f"sequence {seq} has {ix.length} tokens: positions {bad} are unknown")

    def _protected(self, seq: int, ix: _GroupIndex, bad: list[int]) -> ProtectedTokenError:
        w = self.config.recent_window
        return ProtectedTokenError(
            f"positions {bad} of sequence {seq} are inside the protected recent window "
            f"(last {w} of {ix.length} tokens stay H)"
        )

    @staticmethod
    def _released(seq: int, group: int, bad: list[int]) -> AlreadyReleasedError:
        return AlreadyReleasedError(f"positions {bad} of sequence {seq}, group {group} were already released")

    @staticmethod
    def _irreversible(seq: int, group: int, bad: list[int], tier: int, action: Action) -> IrreversibleActionError:
        have, want = _TIER_NAMES[tier], _TIER_NAMES[int(action)]
        return IrreversibleActionError(
            f"positions {bad} of sequence {seq}, group {group} are {have}: {have} cannot go back to {want}"
        )

    @staticmethod
    def _check_fetched(seq: int, group: int, ix: _GroupIndex, pos: torch.Tensor, action: Action) -> None:
        """A fetched token (a KVFetch slot) may only be released (R: it leaves its slot, its cold copy stays)."""
        hit = [p for p in pos.tolist() if p in ix.fetched]
        if not hit:
            return
        if action != Action.R:
            raise IrreversibleActionError(
                f"positions {hit[:5]} of sequence {seq}, group {group} are fetched from the cold tier: "
                "they can only be released"
            )
        ix.fetched.difference_update(hit)

    def _apply_one(self, seq: int, group: int, ix: _GroupIndex, p: int, action: Action) -> None:
        """:meth:`apply` for one position, with the same checks and errors."""
        move = self._prepare_one(seq, group, ix, p, action)
        if move is not None:
            self._finish_moves([move])

    def _prepare_one(self, seq: int, group: int, ix: _GroupIndex, p: int, action: Action) -> _Move | None:
        """Check one position's action and apply it, except a native H -> low move, which it
        prepares (bookkeeping of the H side, low-tier capacity) and returns for :meth:`_finish_moves`."""
        if p < 0 or p >= ix.length:
            raise self._unknown(seq, ix, [p])
        if p >= ix.length - self.config.recent_window:
            raise self._protected(seq, ix, [p])
        tier = int(ix.tier_of.a[p])
        if tier == R:
            raise self._released(seq, group, [p])
        if ix.fetched:
            self._check_fetched(seq, group, ix, torch.tensor([p]), action)
        if tier != H and harm(tier) > harm(action):
            raise self._irreversible(seq, group, [p], tier, action)
        if action == Action.H or tier == int(action):
            return None
        if action != Action.R:
            bits = LOW_BITS[action]
            stores = [self.layers[i].seqs[seq] for i in self.groups[group]]
            native = self.config.native and self.config.latent is None
            if tier != H or not (native and native_attention.move_applies(stores, bits)):
                layers = [self.layers[i] for i in self.groups[group]]
                self._move_to_low(seq, ix, layers, torch.tensor([p]), tier, bits)
                return None
            target = int(action)
            lslot = ix.n[target]
            for st in stores:
                st.low(bits).reserve(1)
            slot, last = ix.remove_one(H, p)
            return _Move(stores, slot, last, lslot, bits, ix, target, p)
        slot, _ = ix.remove_one(tier, p)
        for layer in self._holders(group, tier):
            layer.seqs[seq].tier(tier).remove_one(slot)
        ix.release_one(p)
        return None

    @staticmethod
    def _finish_moves(moves: list[_Move]) -> None:
        """Run prepared H -> low moves (one native call per width, in order) and count them."""
        for bits in sorted({m.bits for m in moves}, reverse=True):
            native_attention.move_to_low([(m.stores, m.slot, m.last, m.lslot) for m in moves if m.bits == bits], bits)
        for m in moves:
            for st in m.stores:
                st.low(m.bits).commit(1)
                st.h.truncate(m.last)
            m.ix.add_one(m.target, m.p)

    def apply_many(self, ops) -> None:
        """Apply ``(seq, group, positions, action)`` decisions in order, as :meth:`apply` (or
        :meth:`recall` for a :class:`~pask.kv.actions.ColdOp`) one by one would, with the same
        checks and errors; single-position H -> INT4 / INT2 moves (a decode step's tokens leaving
        the recent window, over every row and layer group) go to the native kernel in one call."""
        pending: list[_Move] = []
        held: set[tuple[int, int]] = set()  # (seq, group) with a prepared move: a second op there flushes first
        batch = self.config.latent is None  # a latent cache takes apply's own path for everything

        def flush() -> None:
            nonlocal pending
            todo, pending = pending, []
            held.clear()
            self._finish_moves(todo)

        try:
            for seq, group, positions, action in ops:
                one = None
                if isinstance(action, ColdOp):
                    pass
                elif type(positions) is int:
                    one = positions
                else:
                    pos = torch.as_tensor(positions, dtype=torch.long).reshape(-1)
                    one = int(pos[0]) if pos.numel() == 1 else None
                if one is None or (seq, group) in held or not batch:
                    flush()
                    if isinstance(action, ColdOp):
                        self.recall(seq, group, positions, action)
                    else:
                        self.apply(seq, group, positions, action)
                    continue
                self._scratch.clear()
                move = self._prepare_one(seq, group, self.index(seq, group), one, Action(int(action)))
                if move is not None:
                    pending.append(move)
                    held.add((seq, group))
        finally:
            flush()  # what was prepared before an error is still carried out, as one by one

    def _holders(self, group: int, tier: int) -> list[TieredLayer]:
        """The layers of ``group`` whose stores hold ``tier``'s slots: all of them, except the L tier
        of a latent cache, which only the block's source layer holds."""
        lat = self.config.latent
        if lat is not None and tier == L:
            return [self.layers[lat.sources[group]]]
        return [self.layers[i] for i in self.groups[group]]

    def _move_to_low(
        self, seq: int, ix: _GroupIndex, layers: list[TieredLayer], pos: torch.Tensor, tier: int, bits: int
    ) -> None:
        """Quantise the tokens at ``pos`` (all in ``tier``: H, or L when ``bits`` is 2) into the
        ``bits`` tier of every layer of the group and remove them from ``tier``."""
        if pos.numel() == 0:
            return
        slots = ix.slot_of.t[pos].long()
        group = self.group_of[layers[0].layer_idx]
        lat = self.config.latent
        if lat is not None and lat.captures:  # the latent (held beside the source's H slots) moves to its L tier
            src = self.layers[lat.sources[group]].seqs[seq]
            kept = src.h.take(slots)
            src.l.append(**{k: kept[k] for k in src.l.parts})
            layers = []  # no layer keeps its K/V of these tokens
        elif lat is not None:  # pca: the block's exact K/V encoded into its latent, held by its first layer
            kv = [(t["k"], t["v"]) for t in (layer.seqs[seq].h.take(slots) for layer in layers)]
            self.layers[lat.sources[group]].seqs[seq].append_latent(lat.encode_kv(group, kv, pos))
            layers = []
        for layer in layers:
            st = layer.seqs[seq]
            if tier == H:
                st.append_low_from_h(slots, bits)
            else:  # INT4 -> INT2: requantise the dequantised INT4 values
                k, v = st.low_kv(dtype=st.h.parts["k"].dtype, bits=4, slots=slots)
                st.append_low(k, v, bits)
        plan = ix.plan_remove(tier, slots)
        for layer in self._holders(group, tier):
            layer.seqs[seq].tier(tier).remove(*plan)
        ix.remove(tier, pos, plan)
        ix._add(L if bits == 4 else L2, pos.to(torch.int32))

    def _remove(self, seq: int, ix: _GroupIndex, layers: list[TieredLayer], tier: int, pos: torch.Tensor) -> None:
        slots = ix.slot_of.t[pos].long()
        plan = ix.plan_remove(tier, slots)
        for layer in self._holders(self.group_of[layers[0].layer_idx], tier):
            layer.seqs[seq].tier(tier).remove(*plan)
        ix.remove(tier, pos, plan)

    # -- KVFetch's cold tier -------------------------------------------------------------------
    def recall(self, seq: int, group: int, positions, op: ColdOp) -> None:
        """Apply a cold-tier operation (:class:`~pask.kv.actions.ColdOp`) to ``positions`` of ``seq`` in ``group``."""
        op = ColdOp(int(op))
        if self.config.latent is not None:
            raise KVCacheError("a latent cache has no cold tier (KVFetch does not wrap BellowsKV)")
        ix = self.index(seq, group)
        pos = torch.as_tensor(positions, dtype=torch.long).reshape(-1)
        if pos.numel() == 0:
            return
        self._check_known(seq, ix, pos, "cold-tier operation")
        ix.cold_slot.ensure(ix.length)
        layers = [self.layers[i] for i in self.groups[group]]
        tiers = ix.tier_of.t[pos].long()
        cold = ix.cold_slot.t[pos].long()
        if op == ColdOp.DEMOTE:
            self._check_held(seq, group, ix, pos, tiers)
            if bool((cold >= 0).any()):
                bad = pos[cold >= 0][:5].tolist()
                raise KVCacheError(f"positions {bad} of sequence {seq}, group {group} already have a cold copy")
            self._demote(seq, ix, layers, pos, tiers)
        elif op == ColdOp.FETCH:
            bad = pos[(tiers != R) | (cold < 0)]
            if bad.numel():
                raise KVCacheError(
                    f"positions {bad[:5].tolist()} of sequence {seq}, group {group} are not in the cold tier "
                    "(only released tokens with a cold copy can be fetched)"
                )
            for layer in layers:
                st = layer.seqs[seq]
                k, v = st.low_kv(dtype=st.h.parts["k"].dtype, slots=cold, cold=True)
                st.h.append(k=k, v=v)
            ix.unrelease(pos)
            ix._add(H, pos.to(torch.int32))
            ix.fetched.update(pos.tolist())
        else:
            bad = [p for p in pos.tolist() if p not in ix.fetched]
            if bad:
                raise KVCacheError(f"positions {bad[:5]} of sequence {seq}, group {group} were not fetched")
            self._remove(seq, ix, layers, H, pos)
            ix.release(pos)
            ix.fetched.difference_update(pos.tolist())

    def _demote(
        self, seq: int, ix: _GroupIndex, layers: list[TieredLayer], pos: torch.Tensor, tiers: torch.Tensor
    ) -> None:
        """Copy the held tokens at ``pos`` (their current values, dequantised from L / L2) into the
        cold tier of every layer of the group, in ``pos`` order, then release them from attention."""
        parts = [(t, torch.nonzero(tiers == t).squeeze(1)) for t in (H, L, L2)]
        parts = [(t, where) for t, where in parts if where.numel()]
        for layer in layers:
            st = layer.seqs[seq]
            dtype = st.h.parts["k"].dtype
            k = v = None
            for t, where in parts:
                slots = ix.slot_of.t[pos[where]].long()
                if t == H:
                    kv = st.h.take(slots)
                    kt, vt = kv["k"], kv["v"]
                else:
                    kt, vt = st.low_kv(dtype=dtype, bits=LOW_BITS[Action(t)], slots=slots)
                if k is None:
                    shape = (kt.shape[0], pos.numel(), kt.shape[-1])
                    k, v = kt.new_empty(shape), vt.new_empty(shape)
                k[:, where] = kt.to(k.dtype)
                v[:, where] = vt.to(v.dtype)
            st.append_cold(k, v)
        ix.add_cold(pos)
        self._release_held(seq, ix, layers, pos, tiers)

    def compact(self) -> None:
        """Return all spare tier capacity now (tiers also shrink by themselves as tokens leave)."""
        for layer in self.layers:
            for st in layer.seqs:
                if st is not None:
                    for t in st.all_tiers():
                        t.compact()

    def tiers(self, seq: int, group: int) -> torch.Tensor:
        """Tier (Action value) of each position of ``seq`` in ``group`` (int8 [seq_length])."""
        ix = self.index(seq, group)
        return ix.tier_of.t[: ix.length].clone()

    def drop(self, seq: int) -> None:
        """Free a finished sequence's storage; its row may still be fed (ignored, outputs zeros)."""
        self._check_seq(seq)
        self._scratch.clear()
        held, full = self._seq_bytes(seq)
        for i in range(2):
            self._finished.held[i] += held[i]
            self._finished.full[i] += full[i]
        for layer in self.layers:
            if layer.is_initialized:
                layer.seqs[seq] = None
        self._indices[seq] = [_GroupIndex() for _ in self.groups]
        self._indices[seq][0].length = 0
        self.dropped[seq] = True

    # -- moving rows between caches (continuous batching) -------------------------------------
    def adopt(self, other: TieredCache, row: int) -> int:
        """Move row ``row`` of ``other`` (prefilled) into this cache as its new last row; return its index.

        The row's tier storage and position index move by reference (no copy); ``other`` no longer
        holds it (its row reads as dropped, and its bytes are not counted there as finished).
        This cache then decodes (extend mode): rows join a running batch this way.
        """
        other._check_seq(row)
        self._scratch.clear()
        if other.spec != self.spec or other.config != self.config:
            raise KVCacheError("adopt needs caches of the same model layout and CacheConfig")
        if other.mode == "empty":
            raise KVCacheError(f"row {row} has not been prefilled: nothing to adopt")
        if self.mode != "extend" and not all(self.dropped):
            raise KVCacheError("this cache's own rows await their prefill: adopt into a decoding or empty cache")
        for mine, theirs in zip(self.layers, other.layers, strict=True):
            store = theirs.seqs[row] if theirs.is_initialized else None
            if store is not None:
                if not mine.is_initialized:
                    mine.dtype, mine.device = theirs.dtype, theirs.device
                    mine.seqs = [None] * self.num_seqs
                    mine.is_initialized = True
                for t in store.all_tiers():
                    t.stats = self.stats
                theirs.seqs[row] = None
            if mine.is_initialized:
                mine.seqs.append(store)
        self._indices.append(other._indices[row])
        other._indices[row] = [_GroupIndex() for _ in other.groups]
        other.dropped[row] = True
        self.dropped.append(False)
        self.pad_lengths.append(0)
        self.num_seqs += 1
        self.mode = "extend"
        return self.num_seqs - 1

    def compacted(self) -> tuple[TieredCache, dict[int, int]]:
        """A new cache holding this cache's live rows only (in order), and the map old row -> new row.

        Storage moves by reference; the finished-bytes record, the budget meter and the copy stats carry over.
        Rebuilding a running batch this way stops dropped rows from being fed at every step.
        """
        new = TieredCache(self._model_config, self.config, batch_size=0)
        new.stats = self.stats  # the copy counters too
        rows = {b: new.adopt(self, b) for b in range(self.num_seqs) if not self.dropped[b]}
        new._finished, new.meter = self._finished, self.meter
        return new, rows

    # -- bytes --------------------------------------------------------------------------------
    def _seq_bytes(self, seq: int) -> tuple[list[int], list[int]]:
        """([prompt, decode] held bytes, [prompt, decode] full-precision bytes) of one sequence.

        Held bytes come from the tier tensors (live bytes per slot x live slots of each kind);
        full bytes are what the same tokens would take in the H tier.
        """
        held, full = [0, 0], [0, 0]
        for g, ix in enumerate(self._indices[seq]):
            tokens = [sum(ix.counts[t][i] for t in (H, L, L2, R)) for i in range(2)]
            for li in self.groups[g]:
                layer = self.layers[li]
                st = layer.seqs[seq] if layer.is_initialized else None
                if st is None:
                    continue
                for tier, t in ((H, st.h), (L, st.l), (L2, st.l2)):
                    if t.n:
                        per_slot = t.live_bytes() // t.n
                        for i in range(2):
                            held[i] += per_slot * ix.counts[tier][i]
                if st.cold is not None and st.cold.n:  # KVFetch's cold tier holds bytes too
                    per_slot = st.cold.live_bytes() // st.cold.n
                    for i in range(2):
                        held[i] += per_slot * ix.cold_counts[i]
                for i in range(2):
                    full[i] += st.kv_slot_bytes() * tokens[i]
                held[0] += st.balance_bytes()  # per-sequence key balance of the low-bit tiers
        return held, full

    def held_bytes(self) -> int:
        """Bytes of the live K/V slots (H values, INT4 / INT2 codes + scales/zeros) in all tiers' tensors."""
        return sum(st.live_bytes() for layer in self.layers for st in layer.seqs if st is not None)

    def allocated_bytes(self) -> int:
        """Bytes of every tensor the cache owns (tier storage incl. spare capacity, and index metadata)."""
        total = sum(st.allocated_bytes() for layer in self.layers for st in layer.seqs if st is not None)
        for row in self._indices:
            total += sum(ix.nbytes() for ix in row)
        return total

    def full_bytes(self) -> int:
        """Bytes the live tokens would take if all were H (the model dtype: BF16 in production)."""
        _, full = self.budget_bytes(live_only=True)
        return sum(full)

    def budget_bytes(self, live_only: bool = False) -> tuple[list[int], list[int]]:
        """([prompt, decode] held, [prompt, decode] full) bytes, finished sequences included unless live_only."""
        held, full = [0, 0], [0, 0]
        if not live_only:
            held, full = list(self._finished.held), list(self._finished.full)
        for b in range(self.num_seqs):
            if not self.dropped[b]:
                h, f = self._seq_bytes(b)
                for i in range(2):
                    held[i] += h[i]
                    full[i] += f[i]
        return held, full

    def budget(self):
        """Measured budget (see :class:`pask.kv.budget.Budget`)."""
        return self.meter.budget(self)

    def sample_budget(self) -> float:
        """Record one time-average sample (call once per decode step); returns the current B."""
        return self.meter.sample(self)
