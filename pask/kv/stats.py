"""Attention statistics for the policies that ask for them, computed only when asked.

A policy asks through optional class attributes (absent = not asked; :class:`StatsRequest.of`):

``prefill_window: int = 0``
    After the prefill forward, the attention of the last ``w`` prompt queries over all prompt keys
    (causal, softmax over the prompt), summed over those queries and averaged over the query heads
    that share each kv head: ``ctx.prefill_attention [layers, Hkv, prompt_len]`` (each (layer, head)
    row sums to ``min(w, prompt_len)``). ``ALL`` (or any ``w >= prompt_len``) takes every prompt
    query: the accumulated column sums of H2O.
    Cost: ``O(w · P · Hq · D)`` per layer on top of the prefill, scores materialised in blocks of
    at most ``QUERY_BLOCK`` queries and ``SCORE_ELEMENTS`` floats; with ``ALL`` that is a second
    ``QK^T`` of the prompt, about the attention cost of the prefill itself.
``prefill_value_norm: bool = False``
    ``ctx.prefill_value_norm [layers, Hkv, prompt_len]``: ``‖v_t · W_o^{(h)}‖₁`` of every prompt value
    through the output projection slice of each query head, averaged over the query heads of its kv
    head (CriticalKV). Cost: one ``[P, D] x [D, hidden]`` product per query head and layer.
``step_attention: bool = False``
    After every decode step, the attention weights of the new query over the tokens held (H and
    INT4, one softmax), averaged over the query heads of each kv head and put back at their original
    positions: ``ctx.step_attention [layers, Hkv, length]`` (0 at released positions; each row sums
    to 1).
``step_scorer: Callable | None = None``
    A function ``(q [Hkv, grp, D], k [Hkv, n, D], positions [n], scaling) -> [..., Hkv, n]`` (fp32
    inputs) evaluated on every decode step and layer over the held keys; the result goes back to
    original positions as ``ctx.step_scores [layers, ..., Hkv, length]`` (0 where released).

Cost of the step statistics: a decode step then runs :func:`explicit_decode` instead of the fused
CPU fast path: the scores of H and dequantised INT4 keys are computed explicitly in FP32 and
softmaxed once (the same math as the reference path, plus a probability tensor of ``Hq x n`` and a
scatter to positions per layer), so INT4 tokens are dequantised at every step, as in the reference
path. A policy that asks for nothing costs one attribute lookup per layer call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pask.kv.actions import Action
from pask.kv.errors import UnsupportedModelError

ALL = 1 << 30  # prefill_window value: every prompt query
QUERY_BLOCK = 256  # prompt queries scored at a time (fewer for long prompts: see SCORE_ELEMENTS)
SCORE_ELEMENTS = 1 << 23  # at most this many FP32 scores (32 MiB) materialised at once
_ATTR = "_pask_stats"


@dataclass(frozen=True)
class StatsRequest:
    """What a policy asks the session to measure (see the module docstring)."""

    prefill_window: int = 0
    prefill_value_norm: bool = False
    step_attention: bool = False
    step_scorer: Callable | None = None

    @classmethod
    def of(cls, policy) -> StatsRequest:
        """What ``policy`` asks for. These attributes are members of every
        :class:`pask.policies.base.Policy`; ``pask.kv`` sits below ``pask.policies`` and accepts any
        policy object (e.g. a user's object given to :func:`pask.kv_policy`), so a missing one reads
        as "not asked"."""
        return cls(
            prefill_window=int(getattr(policy, "prefill_window", 0) or 0),
            prefill_value_norm=bool(getattr(policy, "prefill_value_norm", False)),
            step_attention=bool(getattr(policy, "step_attention", False)),
            step_scorer=getattr(policy, "step_scorer", None),
        )

    @property
    def prefill(self) -> bool:
        return self.prefill_window > 0 or self.prefill_value_norm

    @property
    def step(self) -> bool:
        return self.step_attention or self.step_scorer is not None

    @property
    def any(self) -> bool:
        return self.prefill or self.step


@functools.cache
def _bf16_gemm_is_slow() -> bool:
    from pask.cpu.bf16_matmul import cpu_has_bf16

    return not cpu_has_bf16()


def _gemm_dtype(t: torch.Tensor) -> torch.Tensor:
    """BF16 operands in FP32 on CPUs without BF16 arithmetic (PyTorch's BF16 GEMM is ~5x slower there)."""
    return t.float() if t.dtype == torch.bfloat16 and t.device.type == "cpu" and _bf16_gemm_is_slow() else t


def window_attention(q: torch.Tensor, k: torch.Tensor, window: int, scaling: float) -> torch.Tensor:
    """Attention of the last ``window`` of ``q [Hq, P, D]`` over ``k [Hkv, P, D]`` (causal) -> ``[Hkv, P]``.

    Summed over the window's queries, averaged over the query heads of each kv head. ``q @ k^T``
    runs in BF16 where the CPU has BF16 arithmetic, else in FP32; the softmax in FP32.
    """
    hq, p, d = q.shape
    hkv = k.shape[0]
    grp = hq // hkv
    w = min(window, p)
    q, k = _gemm_dtype(q), _gemm_dtype(k)
    kt = k.transpose(1, 2)  # [Hkv, D, P]
    out = torch.zeros(hkv, p)
    cols = torch.arange(p)
    block = max(1, min(QUERY_BLOCK, SCORE_ELEMENTS // max(1, hq * p)))
    for a in range(p - w, p, block):
        b = min(p, a + block)
        qb = q[:, a:b].reshape(hkv, grp * (b - a), d)
        s = torch.matmul(qb, kt[..., :b]).float() * scaling  # [Hkv, grp * m, b]: keys after b are masked
        rows = torch.arange(a, b).repeat(grp)
        s.masked_fill_(cols[None, None, :b] > rows[None, :, None], -torch.inf)
        out[:, :b] += torch.softmax(s, dim=-1).sum(dim=1)
    return out / grp


def value_output_norm(v: torch.Tensor, o_proj: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """``‖v_t W_o^{(h)}‖₁`` of ``v [Hkv, P, D]`` for each query head, averaged per kv head -> ``[Hkv, P]``.

    ``o_proj`` is the output projection weight ``[hidden, Hq * D]`` (``nn.Linear`` layout).
    """
    hkv, p, d = v.shape
    grp = num_q_heads // hkv
    wo = _gemm_dtype(o_proj.detach()).t().reshape(num_q_heads, d, -1)  # [Hq, D, hidden]
    out = torch.zeros(hkv, p)
    for h in range(num_q_heads):
        j = h // grp
        out[j] += torch.matmul(v[j].to(wo.dtype), wo[h]).float().abs().sum(dim=-1)
    return out / grp


def explicit_decode(
    q: torch.Tensor,
    store,
    scaling: float,
    pos_h: torch.Tensor,
    pos_l: torch.Tensor,
    scorer: Callable | None = None,
    pos_l2: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One query token ``q [Hq, 1, D]`` over the H, INT4 and INT2 tiers with explicit FP32 scores.

    ``pos_h``, ``pos_l``, ``pos_l2``: the positions of each tier's slots (``pos_l2`` may be None
    when the INT2 tier is empty). Returns ``(out [1, Hq, D] in q's dtype, probs [Hkv, n] averaged
    over each kv head's query heads, positions [n], scorer result or None)``; column ``i`` belongs
    to ``positions[i]``.
    """
    hq, _, d = q.shape
    hkv = store.h.heads
    grp = hq // hkv
    qf = q.float().reshape(hkv, grp, d)
    ks, vs = [], []
    if store.h.n:
        ks.append(store.h.view("k").float())
        vs.append(store.h.view("v").float())
    for bits in (4, 2):
        if store.low(bits).n:
            k, v = store.low_kv(bits=bits)
            ks.append(k)
            vs.append(v)
    k = torch.cat(ks, dim=1) if len(ks) > 1 else ks[0]
    v = torch.cat(vs, dim=1) if len(vs) > 1 else vs[0]
    parts = [pos_h[: store.h.n], pos_l[: store.l.n]]
    if store.l2.n:
        parts.append(pos_l2[: store.l2.n])
    positions = torch.cat(parts).long()
    p = torch.softmax(torch.matmul(qf, k.transpose(1, 2)) * scaling, dim=-1)  # [Hkv, grp, n]
    out = torch.matmul(p, v).reshape(1, hq, d).to(q.dtype)
    extra = scorer(qf, k, positions, scaling) if scorer is not None else None
    return out, p.mean(dim=1), positions, extra


class StatsCollector:
    """Collects the statistics a :class:`StatsRequest` asks for, per row of one TieredCache.

    ``extra_windows`` / ``all_value_norms``: also record the window attention of these windows and
    the value-output norms whatever the request (what a prefill store keeps for other policies).
    """

    def __init__(
        self,
        request: StatsRequest,
        num_layers: int,
        num_rows: int,
        extra_windows: tuple[int, ...] = (),
        all_value_norms: bool = False,
    ):
        self.request = request
        self.num_layers = num_layers
        asked = (request.prefill_window,) if request.prefill_window > 0 else ()
        self.windows = tuple(dict.fromkeys(asked + tuple(extra_windows)))
        self.value_norms = request.prefill_value_norm or all_value_norms
        self.prefill_attention: list[dict[int, torch.Tensor] | None] = [None] * num_rows
        self.prefill_value_norm: list[torch.Tensor | None] = [None] * num_rows
        self.step_attention: list[torch.Tensor | None] = [None] * num_rows
        self.step_scores: list[torch.Tensor | None] = [None] * num_rows

    @property
    def prefill(self) -> bool:
        """Whether anything is recorded during the prefill forward."""
        return bool(self.windows) or self.value_norms

    # -- prefill ------------------------------------------------------------------------------
    def on_prefill(self, module, layer, query, key, value, scaling: float) -> None:
        """Record the prefill statistics of one layer (``query [B, Hq, T, D]``, ``key/value [B, Hkv, T, D]``)."""
        cache = layer.cache
        li = layer.layer_idx
        o_proj = None  # the output projection's weight, read (a quantised one dequantised) once per layer
        for b in range(query.shape[0]):
            if layer.seqs[b] is None:
                continue
            pad = cache.pad_lengths[b]
            p = query.shape[2] - pad
            for w in dict.fromkeys(covering(w, p) for w in self.windows):
                att = window_attention(query[b, :, pad:], key[b, :, pad:], w, scaling)
                if self.prefill_attention[b] is None:
                    self.prefill_attention[b] = {}
                row = self.prefill_attention[b]
                if w not in row:
                    row[w] = torch.zeros(self.num_layers, att.shape[0], p)
                row[w][li] = att
            if self.value_norms:
                if o_proj is None:
                    from pask.cpu.weights import dense_weight

                    o_proj = dense_weight(getattr(module, "o_proj", None))
                if o_proj is None:
                    raise UnsupportedModelError(f"{type(module).__name__} has no o_proj: no value-output norms")
                vn = value_output_norm(value[b, :, pad:], o_proj, query.shape[1])
                self._row(self.prefill_value_norm, b, (self.num_layers, vn.shape[0], p))[li] = vn

    def _row(self, store: list, b: int, shape: tuple) -> torch.Tensor:
        if store[b] is None:
            store[b] = torch.zeros(shape)
        return store[b]

    def recorded_prefill(self, row: int) -> tuple[dict[int, torch.Tensor], torch.Tensor | None]:
        """Everything recorded for ``row`` at prefill: ``({window: [layers, Hkv, P]}, value norms)``."""
        return dict(self.prefill_attention[row] or {}), self.prefill_value_norm[row]

    def put_prefill(self, row: int, windows: dict[int, torch.Tensor], value_norm: torch.Tensor | None) -> None:
        """Hand ``row`` statistics computed elsewhere (a stored prefill) instead of recording them."""
        self.prefill_attention[row] = dict(windows)
        self.prefill_value_norm[row] = value_norm

    def take_prefill(self, row: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The prefill statistics the request asked for, of ``row`` (released by the collector afterwards)."""
        req = self.request
        windows, vn = self.prefill_attention[row] or {}, self.prefill_value_norm[row]
        att = None
        if req.prefill_window > 0 and windows:
            p = next(iter(windows.values())).shape[-1]
            att = windows[covering(req.prefill_window, p)]
        self.prefill_attention[row] = self.prefill_value_norm[row] = None
        return att, vn if req.prefill_value_norm else None

    # -- decode -------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Forget the previous step's statistics (called before each decode forward)."""
        n = len(self.step_attention)
        self.step_attention = [None] * n
        self.step_scores = [None] * n

    def decode(self, layer, seq: int, q: torch.Tensor, scaling: float) -> torch.Tensor:
        """Decode attention of ``q [Hq, 1, D]`` for row ``seq`` via :func:`explicit_decode`, recording the step."""
        req = self.request
        pos_h, pos_l = layer.positions(seq, Action.H), layer.positions(seq, Action.L)
        pos_l2 = layer.positions(seq, Action.L2)
        store = layer.seqs[seq]
        out, probs, positions, extra = explicit_decode(q, store, scaling, pos_h, pos_l, req.step_scorer, pos_l2)
        li = layer.layer_idx
        if req.step_attention:
            self.record_step(layer, seq, probs, positions)
        length = layer.cache.seq_length(seq)
        if extra is not None:
            buf = self._row(self.step_scores, seq, (self.num_layers, *extra.shape[:-1], length))
            buf[li][..., positions] = extra.float()
        return out

    def record_step(self, layer, seq: int, probs: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        """Record the step attention ``probs [Hkv, n]`` of row ``seq`` in ``layer`` (columns: its H slots
        then its INT4 slots, then its INT2 slots, unless ``positions`` names them)."""
        if positions is None:
            store = layer.seqs[seq]
            tiers = ((Action.H, store.h), (Action.L, store.l), (Action.L2, store.l2))
            positions = torch.cat([layer.positions(seq, a)[: t.n] for a, t in tiers]).long()
        buf = self._row(self.step_attention, seq, (self.num_layers, probs.shape[0], layer.cache.seq_length(seq)))
        buf[layer.layer_idx][:, positions] = probs

    @property
    def native_step(self) -> bool:
        """Whether the step statistics asked for are what the native kernel reports (weights only)."""
        return self.request.step_attention and self.request.step_scorer is None

    def take_step(self, row: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.step_attention[row], self.step_scores[row]


def covering(window: int, prompt_len: int) -> int:
    """The window as recorded: one that covers the whole prompt is the same statistic as ``ALL``."""
    return ALL if window >= prompt_len else window


def attach(cache, collector: StatsCollector | None) -> None:
    """Make ``collector`` the statistics collector of ``cache`` (read by the pask attention)."""
    setattr(cache, _ATTR, collector)


def collector_of(cache) -> StatsCollector | None:
    return getattr(cache, _ATTR, None)
