"""KIVI: uniform low-bit KV (4 or 2 bits) with a full-precision residual of recent tokens; nothing is evicted."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pask.errors import PaskError
from pask.kv.actions import Action
from pask.kv.budget import CostModel
from pask.policies._common import check_budget, h_count
from pask.policies.base import ActionSpec, PolicyBase, SeqContext


@dataclass
class KIVIPolicy(PolicyBase):
    """KIVI: a tuning-free asymmetric 2bit quantization for KV cache (Liu et al., ICML 2024).

    Every token outside a full-precision residual of the most recent tokens is quantised (the
    cache's L tier, INT4, for ``kivi-4``; its L2 tier, INT2, for ``kivi-2``); nothing is ever
    released. The residual length follows from the budget: the newest ``h`` tokens stay H with
    ``h + c · (n - h) = budget · n`` (``c`` the low-bit cost: 0.3125 for INT4 and 0.1875 for INT2
    over BF16 at D = 64, g = 32), at least the cache's recent window, so ``budget = c + ε`` is plain
    KIVI with the recent window as residual. A target below ``c + (1 - c) · W / n`` cannot be met
    without eviction: the policy then quantises everything outside the recent window and the
    measured B stays above the target.

    Parameters
    ----------
    budget : float
        Target measured budget B in (0, 1].
    bits : int, default=4
        Code width of the quantised tokens: 4 (``kivi-4``) or 2 (``kivi-2``).

    Notes
    -----
    Deviations: KIVI quantises keys per channel (grouped along tokens) and values per token; the
    cache's low-bit tiers quantise both per token, in groups of ``quant_group`` (32) along head_dim
    with a bf16 scale and zero per group, keys after a per-channel balance (centred on each
    channel's mid-range, divided by the square root of its range: :func:`pask.kv.storage.key_balance`),
    which keeps the per-channel outliers out of the token groups as KIVI's per-channel keys do (its
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
    def l2_key_bits(self) -> int | None:  # type: ignore[override]
        """2 when it stores INT2 tokens (its L2 action is INT2 keys and values, not K4V2); None: no L2."""
        return 2 if 2 in self.widths(1) else None

    def widths(self, num_groups: int) -> list[int]:
        """The code width of each layer group (all ``bits`` here)."""
        return [self.bits] * num_groups

    def _plan(self, ctx: SeqContext) -> list[ActionSpec]:
        n = ctx.length
        widths = self.widths(ctx.num_groups)
        cost = {4: ctx.int4_cost, 2: ctx.int2_cost}
        c = sum(cost[w] for w in widths) / len(widths)
        residual = max(ctx.recent_window, h_count(self.budget, n, c))
        limit = n - residual
        if limit <= 0:
            return []
        tiers = ctx.tiers()
        out: list[ActionSpec] = []
        for g in range(tiers.shape[0]):
            old = torch.nonzero(tiers[g, :limit] == int(Action.H)).squeeze(1)
            if old.numel():
                out.append((g, old, Action.L if widths[g] == 4 else Action.L2))
        return out

    def prefill_actions(self, ctx: SeqContext) -> list[ActionSpec]:
        return self._plan(ctx)

    def step_actions(self, ctx: SeqContext) -> list[ActionSpec]:
        return self._plan(ctx)


#: INT4 and INT2 cost over BF16 at head_dim 64, group 32 (the mix's choice of widths; the residual
#: then uses the cache's measured costs from the SeqContext): the cost model's defaults.
_COST = {4: CostModel().l_ratio, 2: CostModel().l2_ratio}


@dataclass
class KIVIMixPolicy(KIVIPolicy):
    """KIVI with a code width per layer group (``kivi-mix``): the budgets between uniform INT2's floor
    and uniform INT4's are reached by giving ``k`` of the layer groups INT2 and the rest INT4, as a
    user of a per-layer KV-quantisation setting (llama.cpp's per-tensor types, KVTuner's layer-wise
    widths) would configure it.

    ``k`` is the fewest INT2 groups whose all-quantised cost ``((G - k) · c4 + k · c2) / G`` is at or
    below the budget (0 above INT4's floor: then this is ``kivi-4``); the full-precision residual
    then fills the rest of the budget as in :class:`KIVIPolicy`. ``int2_groups`` picks which
    groups get INT2: ``"last"`` (the deepest layers first, the default) or ``"first"``; a tuned
    config chooses on the dev split.

    Parameters
    ----------
    budget : float
        Target measured budget B in (0, 1].
    int2_groups : str, default="last"
        ``"last"`` or ``"first"``: the layer groups that take INT2 first.
    """

    budget: float
    bits: int = field(default=4, init=False)
    int2_groups: str = "last"

    def __post_init__(self) -> None:
        if self.int2_groups not in ("last", "first"):
            raise PaskError(f"kivi-mix: int2_groups must be 'last' or 'first', got {self.int2_groups!r}")
        self.bits = 4
        self.budget = check_budget(self.budget, self.name)

    @property
    def name(self) -> str:
        return "kivi-mix"

    def widths(self, num_groups: int) -> list[int]:
        g = num_groups
        k = next((k for k in range(g + 1) if ((g - k) * _COST[4] + k * _COST[2]) / g <= self.budget + 1e-12), g)
        two = range(g - k, g) if self.int2_groups == "last" else range(k)
        return [2 if i in two else 4 for i in range(g)]


def kivi_factory(bits: int):
    """The registry entry of ``kivi-<bits>``: ``budget`` only (the name fixes the code width)."""

    def make(budget: float) -> KIVIPolicy:
        return KIVIPolicy(budget, bits=bits)

    make.__name__ = make.__qualname__ = f"kivi{bits}"
    return make
