"""CriticalKV: attention-selected tokens first, then attention rescaled by the value-output norm ‖V W_o‖₁."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from pask.policies._common import (
    BIG,
    PromptRanked,
    check_budget,
    check_range,
    check_window_scorer,
    group_scores,
    groups_of,
    keep_count,
    need,
)
from pask.policies.base import SeqContext
from pask.policies.snapkv import POOLINGS, window_scores


@dataclass
class CriticalKVPolicy(PromptRanked):
    """CriticalKV: identify critical KV cache entries from an output-perturbation perspective (Feng et al., 2025,
    arXiv 2502.03805).

    Two stages over the prompt, with SnapKV's pooled observation-window attention ``a`` as the base
    score (as kvpress's CriticalKVPress over SnapKVPress):

    1. the best ``first_stage_ratio`` of the prefix tokens to keep are chosen by ``a`` alone;
    2. the rest of the keep budget goes to the best tokens by ``(a + epsilon) · ‖v W_o‖₁``, the L1
       norm of the token's value through the output projection (the bound on the output perturbation
       its eviction causes), averaged over the query heads of its kv head.

    Budget as :class:`~pask.policies.snapkv.SnapKVPolicy`: ``round(budget · P)`` prompt tokens kept
    at prefill, then the lowest-ranked kept prompt tokens are released as generated tokens arrive.

    Parameters
    ----------
    budget : float
        Target measured budget B in (0, 1].
    first_stage_ratio : float, default=0.5
        Fraction of the prefix keep budget selected by attention alone (Table 8: {0.25, 0.40, 0.50, 0.70}).
    epsilon : float, default=1e-4
        Stabiliser added to the attention before rescaling (Table 8: {1e-5, 1e-4, 1e-3}).
    window : int, default=32
        Observation window of the base scorer (Table 8 "scorer window": {16, 32, 64}).
    kernel : int, default=5
        Pooling kernel of the base scorer (odd; 1 disables pooling).
    pooling : {"avg", "max"}, default="avg"
        Pooling type of the base scorer.
    head_reduce : {"sum", "max", "mean"}, default="sum"
        How the scores of the (layer, kv head) pairs of a layer group are combined.

    Notes
    -----
    Deviations: one selection per layer group instead of per head (the per (layer, head) scores of
    both stages are reduced over the group); in stage 2 each (layer, kv head)'s value norms are divided
    by their mean over the prompt before the reduction, so layers with larger value norms do not
    dominate the group's sum (within one head this leaves the ranking unchanged).
    """

    budget: float
    first_stage_ratio: float = 0.5
    epsilon: float = 1e-4
    window: int = 32
    kernel: int = 5
    pooling: str = "avg"
    head_reduce: str = "sum"

    name: ClassVar[str] = "criticalkv"
    prefill_value_norm: ClassVar[bool] = True
    _prio: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.budget = check_budget(self.budget, self.name)
        self.first_stage_ratio = check_range(self.first_stage_ratio, 0.0, 1.0, "first_stage_ratio", self.name)
        self.epsilon = check_range(self.epsilon, 0.0, 1.0, "epsilon", self.name)
        check_window_scorer(self, POOLINGS)

    def prompt_priority(self, ctx: SeqContext) -> torch.Tensor:
        """``[G, P]``: window, then stage-1 tokens by attention, then the rest by rescaled attention."""
        att = need(ctx.prefill_attention, "prefill attention", self.name)
        vnorm = need(ctx.prefill_value_norm, "prefill value norms", self.name)
        p = ctx.prompt_len
        groups = groups_of(ctx, att.shape[0])
        base = window_scores(att, p, self.window, self.kernel, self.pooling)  # [layers, Hkv, m]
        m = base.shape[-1]
        vn = vnorm[..., :m]
        vn = vn / vn.mean(dim=-1, keepdim=True).clamp_min(1e-12)
        stage1 = group_scores(base, groups, self.head_reduce)  # [G, m]
        stage2 = group_scores((base + self.epsilon) * vn, groups, self.head_reduce)
        window_kept = p - m
        k1 = int(self.first_stage_ratio * max(0, keep_count(self.budget, p) - window_kept))
        pr = torch.zeros(len(groups), p, dtype=torch.float64)
        pr[:, :m] = stage2
        if k1 > 0 and m > 0:
            top = torch.topk(stage1, min(k1, m), dim=-1).indices
            pr[:, :m].scatter_(1, top, BIG + stage1.gather(1, top))
        pos = torch.arange(p, dtype=torch.float64)
        pr[:, m:] = 2 * BIG + pos[m:]
        return pr
