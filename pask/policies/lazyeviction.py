"""LazyEviction: keep tokens whose attention recurs soon, judged by their maximum recurrence interval."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from pask.policies._common import (
    BIG,
    check_budget,
    check_int,
    check_range,
    extend,
    group_scores,
    groups_of,
    keep_count,
    need,
    release_to_count,
)
from pask.policies.base import ActionSpec, PolicyBase, SeqContext

NEVER = -1e18  # "last recurrence" of a token never attended above alpha


@dataclass
class _Rows:
    last: torch.Tensor  # [G, cap] step of the last recurrence (NEVER if none)
    mri: torch.Tensor  # [G, cap] maximum recurrence interval seen (0: fewer than two recurrences)
    acc: torch.Tensor  # [G, cap] accumulated attention (tie-break among never-recurring tokens)


@dataclass
class LazyEvictionPolicy(PolicyBase):
    """LazyEviction: lagged KV eviction with attention pattern observation (Zhang et al., 2025, arXiv 2506.15969).

    A token *recurs* at a step when its attention from the new query is at least ``alpha``
    (averaged over the layers and heads of a layer group). For every token the policy tracks the
    step of its last recurrence and its maximum recurrence interval (MRI), and predicts its next
    recurrence at ``last + max(MRI, 1)``. Eviction keeps the last ``window`` tokens (the observation
    window, never evicted) and ranks the others: tokens whose predicted recurrence has not passed
    (nearest first), then overdue tokens (least overdue first), then tokens that never recurred (by
    accumulated attention); the lowest-ranked are released so that ``round(budget · n)`` are held.

    At prefill the observation window's queries are the first observation: a prompt token recurs at
    step 0 if its mean attention from the window's queries is at least ``alpha``.

    Parameters
    ----------
    budget : float
        Target measured budget B in (0, 1].
    window : int, default=16
        Observation / recent window (Table 8: {8, 16, 32, 64}): the last tokens, never evicted, and
        the prompt queries observed at prefill.
    alpha : float, default=1e-4
        Attention threshold of a recurrence (Table 8: {1e-5, 1e-4, 3e-4, 1e-3}).

    Notes
    -----
    Deviations. (1) The paper evicts in a batch every ``window`` steps; between two batches the cache
    grows by up to ``window`` tokens, so the measured B would overshoot the target by up to
    ``window · (1 - B) / n``. Here the same ranking is applied after every step (recurrences are
    tracked every step either way), which keeps B at the target. (2) One selection per layer group;
    attention is averaged over the group's layers and heads before the threshold.
    """

    budget: float
    window: int = 16
    alpha: float = 1e-4

    name: ClassVar[str] = "lazyeviction"
    step_attention: ClassVar[bool] = True
    _rows: dict = field(default_factory=dict, init=False, repr=False)  # per row ``seq``, dropped by reset

    def __post_init__(self) -> None:
        self.budget = check_budget(self.budget, self.name)
        check_int(self.window, 1, "window", self.name)
        self.alpha = check_range(self.alpha, 0.0, 1.0, "alpha", self.name, lo_open=True)

    @property
    def prefill_window(self) -> int:
        return self.window

    def reset(self, seq: int) -> None:
        """Forget row ``seq``'s recurrence statistics."""
        self._rows.pop(seq, None)

    def prefill_actions(self, ctx: SeqContext) -> list[ActionSpec]:
        att = need(ctx.prefill_attention, "prefill attention", self.name)
        p = ctx.prompt_len
        mean = group_scores(att, groups_of(ctx, att.shape[0]), "mean") / max(1, min(self.window, p))
        last = torch.where(mean >= self.alpha, 0.0, NEVER)
        self._rows[ctx.seq] = _Rows(last=last, mri=torch.zeros_like(mean), acc=mean.clone())
        return self._plan(ctx, step=0)

    def step_actions(self, ctx: SeqContext) -> list[ActionSpec]:
        att = need(ctx.step_attention, "step attention", self.name)
        n, s = ctx.length, ctx.length - ctx.prompt_len
        st = self._rows[ctx.seq]
        st.last, st.mri, st.acc = extend(st.last, n, NEVER), extend(st.mri, n), extend(st.acc, n)
        self.observe(st, group_scores(att, groups_of(ctx, att.shape[0]), "mean"), s)
        return self._plan(ctx, step=s)

    def observe(self, st: _Rows, attention: torch.Tensor, step: int) -> None:
        """Record the recurrences of one step (``attention [G, n]``)."""
        n = attention.shape[-1]
        hit = attention >= self.alpha
        last, mri = st.last[:, :n], st.mri[:, :n]
        seen = hit & (last > NEVER / 2)
        mri[seen] = torch.maximum(mri[seen], step - last[seen])
        last[hit] = float(step)
        st.acc[:, :n] += attention

    def priority(self, st: _Rows, n: int, step: int) -> torch.Tensor:
        """``[G, n]``: window, then due soonest, then least overdue, then never recurred."""
        last, mri, acc = st.last[:, :n].double(), st.mri[:, :n].double(), st.acc[:, :n].double()
        due = last + mri.clamp_min(1.0) - step  # steps until the predicted recurrence (< 0: overdue)
        never = last <= NEVER / 2
        pr = torch.where(due >= 0, 2 * BIG + (BIG / 2 - due), BIG + (BIG / 2 + due))
        pr = torch.where(never, acc, pr)
        pos = torch.arange(n, dtype=torch.float64)
        win = pos >= n - self.window
        pr[:, win] = 3 * BIG + pos[win]
        return pr

    def _plan(self, ctx: SeqContext, step: int) -> list[ActionSpec]:
        n = ctx.length
        pr = self.priority(self._rows[ctx.seq], n, step)
        return release_to_count(ctx, pr, keep_count(self.budget, n))
