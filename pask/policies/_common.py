"""Shared pieces of the budget-controlled baselines: validation, head/layer aggregation, budget plans.

Budget control. The measured budget of a sequence is ``B = Σ_g |g| · held_g / (L · n)`` with
``held_g = #H + c · #L`` tokens of layer group ``g`` (``c = ctx.int4_cost``: 0.3125 for BF16 at
D = 64, g = 32; 0.156 in FP32 test runs), ``n`` the tokens stored and ``L`` the layers. Every
policy here keeps the same held cost in every group, so ``B = held / n`` and a policy meets a target
``b`` by holding ``round(b · n)`` (eviction policies) or ``h`` H tokens and ``n - h`` INT4 tokens
with ``h + c (n - h) = b · n`` (mixed precision). ``n`` grows by one per decode step, so every policy
re-plans after each step; the recent window (``ctx.recent_window``, always H) counts against the
budget. The plan is met within ``1 / (2n)`` unless the recent window alone exceeds it.

Heads. An action applies to every kv head of a token in every layer of a group, so per (layer,
kv head) scores are reduced to one score per (group, token) by :func:`group_scores`: ``"sum"``
(total attention mass of the token in the group; the default), ``"max"`` (a token that matters to
one head is kept, closer to per-head selection) or ``"mean"``.

Priorities. A plan ranks tokens by one float64 priority per (group, position), higher kept first;
protected classes (sink, observation window, generated tokens, ...) are lifted by multiples of
:data:`BIG`, which is far above any attention sum.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from pask.errors import PaskError
from pask.kv.actions import Action
from pask.kv.budget import check_budget as kv_check_budget
from pask.kv.stats import ALL
from pask.policies.base import ActionSpec, PolicyBase, SeqContext

BIG = 1e12  # priority step between protected classes (attention sums stay far below it)
REDUCES = ("sum", "max", "mean")
R = int(Action.R)
H = int(Action.H)


def check_budget(budget, policy: str) -> float:
    """The target budget as a float in (0, 1], else PaskError (:func:`pask.kv.budget.check_budget`)."""
    return kv_check_budget(budget, f"{policy}: budget")


def check_choice(value, choices, what: str, policy: str):
    if value not in choices:
        raise PaskError(f"{policy}: {what} must be one of {', '.join(map(str, choices))}; got {value!r}")
    return value


def check_int(value, minimum: int, what: str, policy: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PaskError(f"{policy}: {what} must be an integer >= {minimum}, got {value!r}")
    return value


def check_kernel(value, policy: str) -> int:
    """A pooling kernel: an odd integer >= 1 (same-length pooling)."""
    check_int(value, 1, "kernel", policy)
    if value % 2 == 0:
        raise PaskError(f"{policy}: kernel must be odd (same-length pooling), got {value}")
    return value


def check_range(value, lo: float, hi: float, what: str, policy: str, lo_open: bool = False) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise PaskError(f"{policy}: {what} must be a number, got {value!r}") from None
    if math.isnan(v) or v > hi or v < lo or (lo_open and v == lo):
        raise PaskError(f"{policy}: {what} must be in {'(' if lo_open else '['}{lo}, {hi}], got {value}")
    return v


def need(stat: torch.Tensor | None, what: str, policy: str) -> torch.Tensor:
    """A statistic the policy asked for (a clear error if the session did not provide it)."""
    if stat is None:
        raise PaskError(f"{policy}: the session gave no {what}; run it through a TieredSession (pask.runtime.session)")
    return stat


def groups_of(ctx: SeqContext, num_layers: int) -> list[range]:
    """The layer groups of ``ctx`` (split evenly when the context carries none, as the cache does)."""
    if ctx.groups:
        return list(ctx.groups)
    from pask.kv.cache import layer_groups

    return layer_groups(num_layers, ctx.num_groups)


def group_scores(stat: torch.Tensor, groups: list[range], reduce: str = "sum") -> torch.Tensor:
    """Reduce ``stat [layers, ..., n]`` over each group's layers and all middle dims -> ``[G, n]`` float64."""
    if stat.shape[-1] == 0:  # e.g. a prompt no longer than SnapKV's window: nothing to score
        return torch.zeros((len(groups), 0), dtype=torch.float64)
    out = []
    for g in groups:
        x = stat[g.start : g.stop].reshape(-1, stat.shape[-1]).double()
        if reduce == "sum":
            out.append(x.sum(dim=0))
        elif reduce == "max":
            out.append(x.amax(dim=0))
        else:
            out.append(x.mean(dim=0))
    return torch.stack(out)


def pool1d(x: torch.Tensor, kernel: int, pooling: str) -> torch.Tensor:
    """1-D pooling along the last dim with stride 1 and ``kernel // 2`` padding (same length; odd kernel)."""
    if kernel <= 1 or x.shape[-1] == 0:
        return x
    shape = x.shape
    y = x.reshape(-1, 1, shape[-1]).float()
    pad = kernel // 2
    if pooling == "max":
        y = F.max_pool1d(y, kernel, stride=1, padding=pad)
    else:  # SnapKV / kvpress: average with the zero padding counted
        y = F.avg_pool1d(y, kernel, stride=1, padding=pad)
    return y[..., : shape[-1]].reshape(shape)


def keep_count(budget: float, n: int) -> int:
    """Tokens to hold (all H) so that ``held / n`` is nearest to ``budget``."""
    return min(n, math.floor(budget * n + 0.5))


def h_count(budget: float, n: int, cost: float) -> int:
    """H tokens of a mix of H and INT4 (nothing released) nearest to ``budget``: ``h + c (n - h) = b n``."""
    if budget >= 1.0:
        return n
    if budget <= cost:
        return 0
    return min(n, math.floor((budget - cost) / (1.0 - cost) * n + 0.5))


def release_to_count(ctx: SeqContext, priority: torch.Tensor, keep: int) -> list[ActionSpec]:
    """Per group, release the held tokens outside the recent window beyond the ``keep`` best by ``priority``.

    ``priority [G, >= length]``: higher is kept first (ties: earlier position kept). The recent
    window is always held and counts towards ``keep``.
    """
    tiers = ctx.tiers()
    n = ctx.length
    limit = max(0, n - ctx.recent_window)
    out: list[ActionSpec] = []
    for g in range(tiers.shape[0]):
        cand = torch.nonzero(tiers[g, :limit] != R).squeeze(1)
        room = max(0, keep - (n - limit))
        if cand.numel() <= room:
            continue
        order = torch.argsort(priority[g, cand], descending=True, stable=True)
        drop = torch.sort(cand[order[room:]]).values
        out.append((g, drop, Action.R))
    return out


def protected_window(n: int, size: int) -> torch.Tensor:
    """Bool mask of the last ``size`` of ``n`` positions."""
    pos = torch.arange(n)
    return pos >= n - size


def extend(x: torch.Tensor | None, n: int, fill: float = 0.0) -> torch.Tensor:
    """``x [..., m]`` padded with ``fill`` to ``[..., n]`` (capacity doubling to keep appends amortised)."""
    if x.shape[-1] >= n:
        return x
    cap = max(n, 2 * x.shape[-1])
    out = torch.full((*x.shape[:-1], cap), fill, dtype=x.dtype)
    out[..., : x.shape[-1]] = x
    return out


def start_accumulation(store: dict, ctx: SeqContext, policy: str) -> None:
    """H2O-style importance: a sequence's accumulated attention starts from its prefill column sums."""
    store[ctx.seq] = need(ctx.prefill_attention, "prefill attention", policy).clone()


def accumulate_step(store: dict, ctx: SeqContext, policy: str) -> None:
    """Add the newest decode query's attention to the sequence's accumulated attention."""
    step = need(ctx.step_attention, "step attention", policy)
    acc = extend(store[ctx.seq], ctx.length)
    acc[..., : ctx.length] += step
    store[ctx.seq] = acc


def check_window_scorer(policy, pooling: tuple[str, ...] = ("avg", "max")) -> None:
    """Validate the observation-window scorer fields (``window``, ``kernel``, ``pooling``, ``head_reduce``)."""
    check_int(policy.window, 1, "window", policy.name)
    check_kernel(policy.kernel, policy.name)
    if hasattr(policy, "pooling"):
        check_choice(policy.pooling, pooling, "pooling", policy.name)
    check_choice(policy.head_reduce, REDUCES, "head_reduce", policy.name)


def with_generated(prompt_priority: torch.Tensor, n: int) -> torch.Tensor:
    """Prompt priorities ``[G, P]`` extended to ``n`` positions: generated tokens above all prompt tokens."""
    g, p = prompt_priority.shape
    if n <= p:
        return prompt_priority
    pos = torch.arange(p, n, dtype=torch.float64)
    return torch.cat([prompt_priority, (4 * BIG + pos).expand(g, n - p)], dim=1)


class PromptRanked(PolicyBase):
    """Mixin of the policies that rank the prompt once, at prefill, from the observation window.

    The subclass gives ``prompt_priority(ctx) -> [G, P]``, a ``window`` field and a ``_prio`` dict
    field (the ranking per row ``seq``, dropped by :meth:`reset`). Every plan holds
    ``round(budget · n)`` tokens: generated tokens above the prompt, the lowest-ranked prompt tokens
    released first (so the kept prompt set is always a prefix of the prefill ranking).
    """

    @property
    def prefill_window(self) -> int:
        return self.window

    def reset(self, seq: int) -> None:
        """Forget row ``seq``'s prefill ranking."""
        self._prio.pop(seq, None)

    def prefill_actions(self, ctx: SeqContext) -> list[ActionSpec]:
        self._prio[ctx.seq] = self.prompt_priority(ctx)
        return self.step_actions(ctx)

    def step_actions(self, ctx: SeqContext) -> list[ActionSpec]:
        pr = with_generated(self._prio[ctx.seq], ctx.length)
        return release_to_count(ctx, pr, keep_count(self.budget, ctx.length))

    def ranking(self, ctx: SeqContext) -> torch.Tensor | None:
        """The prefill ranking (generated tokens above it), or None before the row's prefill."""
        prio = self._prio.get(ctx.seq)
        return None if prio is None else with_generated(prio, ctx.length)


class AttentionAccumulating(PolicyBase):
    """Mixin of the policies that rank by accumulated attention (H2O's heavy hitters).

    Asks for every prompt query's attention at prefill and each decode query's after every step;
    the subclass gives a ``_acc`` dict field (the accumulation per row ``seq``, dropped by
    :meth:`reset`) and ``_plan(ctx)``, called with the accumulation up to date.
    """

    prefill_window = ALL
    step_attention = True

    def reset(self, seq: int) -> None:
        """Forget row ``seq``'s accumulated attention."""
        self._acc.pop(seq, None)

    def prefill_actions(self, ctx: SeqContext) -> list[ActionSpec]:
        start_accumulation(self._acc, ctx, self.name)
        return self._plan(ctx)

    def step_actions(self, ctx: SeqContext) -> list[ActionSpec]:
        accumulate_step(self._acc, ctx, self.name)
        return self._plan(ctx)
