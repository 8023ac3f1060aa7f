"""StaticMixPolicy: fixed fractions of H / INT4 / INT2 / release, assigned by position."""

from __future__ import annotations

import torch

from pask.errors import PaskError
from pask.kv.actions import Action
from pask.policies.base import ActionSpec, PolicyBase, SeqContext

GOLDEN = 0.6180339887498949  # frac(p * golden) is a low-discrepancy sequence over positions


class StaticMixPolicy(PolicyBase):
    """Token at position ``p`` gets H if ``u < h``, L if ``u < h + l``, L2 if ``u < h + l + l2``, else R,
    with ``u = frac(p * φ⁻¹)``.

    Deterministic, the same in every layer group, and well mixed: over any N consecutive
    positions each fraction is met within O(log N / N). Tokens in the recent window stay H.
    A reference, not budget-controlled: no ``budget`` target (``target_b`` is 1).
    """

    name = "static_mix"
    budget: float | None = None

    def __init__(self, h: float = 1 / 3, l: float = 1 / 3, r: float = 1 / 3, l2: float = 0.0):  # noqa: E741
        fracs = (float(h), float(l), float(r), float(l2))
        if any(not f >= 0 for f in fracs) or abs(sum(fracs) - 1.0) > 1e-6:
            raise PaskError(f"static mix fractions must be >= 0 and sum to 1 (±1e-6), got h={h}, l={l}, l2={l2}, r={r}")
        self.h, self.l, self.r, self.l2 = fracs

    def assign(self, positions: torch.Tensor) -> torch.Tensor:
        """Action (as int) of each position."""
        u = torch.frac(positions.to(torch.float64) * GOLDEN)
        out = torch.full(positions.shape, int(Action.R), dtype=torch.long)
        out[u < self.h + self.l + self.l2] = int(Action.L2)
        out[u < self.h + self.l] = int(Action.L)
        out[u < self.h] = int(Action.H)
        return out

    def _actions(self, ctx: SeqContext) -> list[ActionSpec]:
        pos = ctx.leaving.to(torch.long)
        if pos.numel() == 0:
            return []
        acts = self.assign(pos)
        out: list[ActionSpec] = []
        for action in (Action.L, Action.L2, Action.R):
            sel = pos[acts == int(action)]
            if sel.numel():
                out.extend((g, sel, action) for g in range(ctx.num_groups))
        return out

    def prefill_actions(self, ctx: SeqContext) -> list[ActionSpec]:
        return self._actions(ctx)

    def step_actions(self, ctx: SeqContext) -> list[ActionSpec]:
        return self._actions(ctx)
