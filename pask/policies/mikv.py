"""MiKV: important tokens in full precision, the others kept in INT4 or INT2 instead of evicted."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from pask.errors import PaskError
from pask.kv.actions import Action
from pask.policies._common import (
    REDUCES,
    AttentionAccumulating,
    check_budget,
    check_choice,
    group_scores,
    groups_of,
    h_count,
)
from pask.policies.base import ActionSpec, SeqContext

H, L = int(Action.H), int(Action.L)


@dataclass
class MiKVPolicy(AttentionAccumulating):
    """MiKV: No token left behind — reliable KV cache compression via importance-aware mixed precision
    quantization (Yang et al., 2024, arXiv 2402.18096).

    H2O-style importance (accumulated attention of every query seen, re-ranked after every decode
    step) picks the tokens kept in full precision; every other token is kept in low precision (the
    cache's INT4 tier, or its INT2 tier with ``bits=2``: per-token asymmetric, group
    ``CacheConfig.quant_group`` along head_dim) instead of being evicted. The high-precision count
    follows from the budget: ``h + c · (n - h) = budget · n`` with ``c`` the low-bit cost (0.3125 for
    INT4, 0.1875 for INT2 over BF16), so the high-precision ratio of Table 8 ({0.1, ..., 0.4}) is
    ``(budget - c) / (1 - c)``. A token once in low precision stays there.

    Parameters
    ----------
    budget : float
        Target measured budget B in (0, 1].
    bits : int, default=4
        Low-precision width: 4 (INT4) or 2 (INT2; Table 8 lists both). The frontier sweep runs
        MiKV at 2 bits, which reaches budgets down to INT2's floor without releasing.
    head_reduce : {"sum", "max", "mean"}, default="sum"
        How the accumulated attention of the (layer, kv head) pairs of a layer group is combined.

    Notes
    -----
    Deviations. (1) Key outlier balancing is the cache's, for every policy
    (:func:`pask.kv.storage.key_balance`: keys centred per channel and divided by the square root of
    the channel range before the per-token quantisation, undone on the query in the attention); it
    is fixed per sequence and layer at the first INT4 write, where MiKV derives its factors from the
    query/key channel statistics. (2) The group size is the cache's (``CacheConfig.quant_group``, 32
    by default) for all tokens. (3) A target below what the recent window plus everything else in
    INT4 costs (``c + (1 - c) · W / n``: below the INT4 cost, where MiKV would use 2 bits, or just
    above it for short sequences) keeps the recent window in H, the most important remaining tokens
    in INT4 and releases the least important ones, so that the budget holds. (4) One selection per
    layer group.
    """

    budget: float
    bits: int = 4
    head_reduce: str = "sum"

    name: ClassVar[str] = "mikv"
    _acc: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.budget = check_budget(self.budget, self.name)
        if self.bits not in (2, 4):
            raise PaskError(f"{self.name}: bits must be 4 or 2, got {self.bits!r}")
        check_choice(self.head_reduce, REDUCES, "head_reduce", self.name)

    @property
    def l2_key_bits(self) -> int | None:  # type: ignore[override]
        """2 with an INT2 low tier (INT2 keys and values, not K4V2); None at 4 bits."""
        return 2 if self.bits == 2 else None

    def _plan(self, ctx: SeqContext) -> list[ActionSpec]:
        n = ctx.length
        c = ctx.int4_cost if self.bits == 4 else ctx.int2_cost
        low = Action.L if self.bits == 4 else Action.L2
        acc = self._acc[ctx.seq]
        imp = group_scores(acc[..., :n], groups_of(ctx, acc.shape[0]), self.head_reduce)
        tiers = ctx.tiers()
        limit = max(0, n - ctx.recent_window)
        window = n - limit
        h_total = h_count(self.budget, n, c)
        h_room = max(0, h_total - window)  # H tokens allowed outside the window
        l_room = None  # INT4 tokens allowed outside the window when even all-INT4 would exceed the target
        if h_total <= window and window + c * (n - window) > self.budget * n + 1e-9:
            l_room = max(0, math.floor((self.budget * n - window) / c + 1e-9))
        out: list[ActionSpec] = []
        for g in range(tiers.shape[0]):
            t = tiers[g, :limit]
            cand = torch.nonzero(t != int(Action.R)).squeeze(1)
            order = cand[torch.argsort(imp[g, cand], descending=True, stable=True)]
            is_h = t[order] == H
            keep_h = is_h & (torch.cumsum(is_h.long(), 0) <= h_room)  # the most important H tokens stay H
            rest = order[~keep_h]
            if l_room is not None and rest.numel() > l_room:
                release, rest = rest[l_room:], rest[:l_room]
                out.append((g, torch.sort(release).values, Action.R))
            demote = rest[t[rest] == H]
            if demote.numel():
                out.append((g, torch.sort(demote).values, low))
        return out
