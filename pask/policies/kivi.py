"""KIVI: uniform low-bit KV (4 or 2 bits) with a full-precision residual of recent tokens; nothing is evicted."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pask.errors import PaskError
from pask.kv.actions import Action
from pask.policies._common import check_budget, h_count
from pask.policies.base import ActionSpec, PolicyBase, SeqContext


@dataclass
class KIVIPolicy(PolicyBase):
    """KIVI: a tuning-free asymmetric 2bit quantization for KV cache (Liu et al., ICML 2024).

    Every token outside a full-precision residual of the most recent tokens is quantised (the
    cache's L tier, INT4 for ``kivi-4`` and INT2 for ``kivi-2``: the policy's ``low_bits`` sets the
    cache's tier width); nothing is ever released. The residual length follows from the budget:
    the newest ``h`` tokens stay H with ``h + c · (n - h) = budget · n`` (``c`` the L cost: 0.3125
    for INT4 and 0.1875 for INT2 over BF16 at D = 64, g = 32), at least the cache's recent window,
    so ``budget = c + ε`` is plain KIVI with the recent window as residual. A target below
    ``c + (1 - c) · W / n`` cannot be met without eviction: the policy then quantises everything
    outside the recent window and the measured B stays above the target.

    Parameters
    ----------
    budget : float
        Target measured budget B in (0, 1].
    bits : int, default=4
        Code width of the quantised tokens: 4 (``kivi-4``) or 2 (``kivi-2``).

    Notes
    -----
    Deviations: KIVI quantises keys per channel (grouped along tokens) and values per token; the
    cache's INT4 tier quantises both per token, in groups of ``quant_group`` (32) along head_dim with
    a bf16 scale and zero per group, keys after a per-channel balance (centred on each channel's
    mid-range, divided by the square root of its range: :func:`pask.kv.storage.key_balance`), which
    keeps the per-channel outliers out of the token groups as KIVI's per-channel keys do (its
    attention error is at or below per-channel quantisation on qwen2.5-coder-0.5b). KIVI flushes its
    residual in blocks of R tokens; here it slides one token per step, and its length is set by the
    budget.
    """

    budget: float
    bits: int = 4

    def __post_init__(self) -> None:
        if self.bits not in (2, 4):
            raise PaskError(f"kivi: bits must be 2 or 4, got {self.bits!r}")
        self.budget = check_budget(self.budget, self.name)

    @property
    def name(self) -> str:
        return f"kivi-{self.bits}"

    @property
    def low_bits(self) -> int:
        """The L-tier code width this policy needs from the cache (see :func:`pask.kv.cache.config_for`)."""
        return self.bits

    def _plan(self, ctx: SeqContext) -> list[ActionSpec]:
        n = ctx.length
        residual = max(ctx.recent_window, h_count(self.budget, n, ctx.int4_cost))
        limit = n - residual
        if limit <= 0:
            return []
        tiers = ctx.tiers()
        out: list[ActionSpec] = []
        for g in range(tiers.shape[0]):
            old = torch.nonzero(tiers[g, :limit] == int(Action.H)).squeeze(1)
            if old.numel():
                out.append((g, old, Action.L))
        return out

    def prefill_actions(self, ctx: SeqContext) -> list[ActionSpec]:
        return self._plan(ctx)

    def step_actions(self, ctx: SeqContext) -> list[ActionSpec]:
        return self._plan(ctx)


def kivi_factory(bits: int):
    """The registry entry of ``kivi-<bits>``: ``budget`` only (the name fixes the code width)."""

    def make(budget: float) -> KIVIPolicy:
        return KIVIPolicy(budget, bits=bits)

    make.__name__ = make.__qualname__ = f"kivi{bits}"
    return make
