"""RocketKV: SnapKV++ prompt compression, then hybrid-sparse-attention top-k selection at every decode step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from pask.policies._common import (
    BIG,
    R,
    check_budget,
    check_int,
    check_range,
    check_window_scorer,
    group_scores,
    groups_of,
    keep_count,
    need,
    release_to_count,
)
from pask.policies.base import ActionSpec, PolicyBase, SeqContext
from pask.policies.snapkv import window_scores


def hsa_scores(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, scaling: float, topr: int, page_size: int
) -> torch.Tensor:
    """Hybrid-sparse-attention approximate scores of one query over held keys -> ``[2, Hkv, n]``.

    ``q [Hkv, grp, D]``, ``k [Hkv, n, D]`` (FP32), ``positions [n]``. Only the ``topr`` dimensions
    with the largest ``|q|`` (summed over the kv head's query heads) are read. Row 0: page score:
    keys are grouped in pages of ``page_size`` consecutive held positions, each page keeps the
    element-wise max and min of its keys, and a page scores ``Σ_i max(q_i · kmax_i, q_i · kmin_i)``
    (the sign-aware upper bound); softmax over pages, broadcast to the page's tokens. Row 1: token
    score: softmax of ``q_r · k_r`` with SparQ's temperature correction. Both are averaged over the
    query heads of each kv head.
    """
    hkv, grp, d = q.shape
    n = k.shape[1]
    r = max(1, min(d, topr))
    idx = q.abs().sum(dim=1).topk(r, dim=-1).indices  # [Hkv, r]
    qr = q.gather(2, idx[:, None, :].expand(hkv, grp, r))
    kr = k.gather(2, idx[:, None, :].expand(hkv, n, r))
    frac = (qr.abs().sum(-1) / q.abs().sum(-1).clamp_min(1e-12)).clamp_min(1e-6)  # [Hkv, grp]
    temp = scaling / frac.sqrt()  # SparQ: 1 / sqrt(D · ‖q_r‖₁ / ‖q‖₁)
    token = torch.softmax(torch.matmul(qr, kr.transpose(1, 2)) * temp[..., None], dim=-1).mean(dim=1)
    order = torch.argsort(positions)
    pages = -(-n // page_size)
    pad = pages * page_size - n
    ks = kr[:, order]
    if pad:
        ks = torch.cat([ks, ks[:, -1:].expand(hkv, pad, r)], dim=1)
    ks = ks.reshape(hkv, pages, page_size, r)
    kmax, kmin = ks.amax(dim=2), ks.amin(dim=2)  # [Hkv, pages, r]
    bound = torch.maximum(qr[:, :, None, :] * kmax[:, None], qr[:, :, None, :] * kmin[:, None]).sum(-1)
    page = torch.softmax(bound * temp[..., None], dim=-1).mean(dim=1)  # [Hkv, pages]
    page_of_slot = torch.empty(n, dtype=torch.long)
    page_of_slot[order] = torch.arange(n) // page_size
    return torch.stack([page[:, page_of_slot], token])


@dataclass
class RocketKVPolicy(PolicyBase):
    """RocketKV: accelerating long-context LLM inference via two-stage KV cache compression (Behnam et al.,
    ICML 2025).

    Stage 1 (prefill, SnapKV++): the observation window's attention, max-pooled with a large kernel,
    ranks the prompt; the prompt is cut to ``budget + prefill_ratio · (1 - budget)`` of its tokens
    (more than the final budget: stage 2 chooses among them). Stage 2 (every decode step, hybrid
    sparse attention): the new query's approximate scores (:func:`hsa_scores`: top-``topr`` query
    dimensions, page min/max bounds over ``page_size`` tokens) pick, per layer group, the pages that
    cover ``page_factor`` times the keep budget, then the best tokens in them by the approximate token
    score; the tokens held are cut to ``round(budget · n)``.

    Parameters
    ----------
    budget : float
        Target measured budget B in (0, 1].
    window : int, default=32
        Stage-1 observation window (Table 8: {16, 32, 64, 128}); its tokens are kept by stage 1.
    kernel : int, default=63
        Stage-1 max-pooling kernel, odd (Table 8: {31, 63, 127}).
    prefill_ratio : float, default=0.25
        Stage-1 slack: the share of the prompt above the budget that stage 1 keeps for stage 2 to
        choose from (Table 8 "prefill ratio": {0.20, 0.25, 0.30, 0.35}; see Notes).
    topr : int, default=32
        Query dimensions read by the approximate scores (RocketKV's top-r; at most head_dim).
    page_size : int, default=4
        Tokens per page of the min/max key summary (RocketKV / TensorRT-LLM default 4).
    page_factor : float, default=2.0
        Pages kept by the page filter, in multiples of the token keep budget.
    head_reduce : {"sum", "max", "mean"}, default="sum"
        How the scores of the (layer, kv head) pairs of a layer group are combined.

    Notes
    -----
    Deviations. (1) Stage 2 in the paper is non-destructive: every step reads only its top-k tokens
    but the stage-1 cache stays in memory. Here the budget is bytes held, so stage 2 is emulated as a
    per-step top-k selection that releases what it does not select (changing what attention reads
    without releasing would need a sparse attention kernel). (2) ``prefill_ratio`` is read as
    stage-1 slack above the budget (stage 1 keeping less than the budget would make the measured B
    miss the target). (3) One selection per layer group; SnapKV++'s adaptive pooling size is the
    fixed ``kernel``.
    """

    budget: float
    window: int = 32
    kernel: int = 63
    prefill_ratio: float = 0.25
    topr: int = 32
    page_size: int = 4
    page_factor: float = 2.0
    head_reduce: str = "sum"

    name: ClassVar[str] = "rocketkv"

    def __post_init__(self) -> None:
        self.budget = check_budget(self.budget, self.name)
        check_window_scorer(self)
        self.prefill_ratio = check_range(self.prefill_ratio, 0.0, 1.0, "prefill_ratio", self.name)
        check_int(self.topr, 1, "topr", self.name)
        check_int(self.page_size, 1, "page_size", self.name)
        self.page_factor = check_range(self.page_factor, 1.0, 1e6, "page_factor", self.name)

    @property
    def prefill_window(self) -> int:
        return self.window

    def step_scorer(self, q, k, positions, scaling):
        return hsa_scores(q, k, positions, scaling, self.topr, self.page_size)

    # -- stage 1 --------------------------------------------------------------------------------
    def prefill_actions(self, ctx: SeqContext) -> list[ActionSpec]:
        att = need(ctx.prefill_attention, "prefill attention", self.name)
        p = ctx.prompt_len
        groups = groups_of(ctx, att.shape[0])
        scores = window_scores(att, p, self.window, self.kernel, "max")
        m = scores.shape[-1]
        pr = torch.zeros(len(groups), p, dtype=torch.float64)
        pr[:, :m] = group_scores(scores, groups, self.head_reduce)
        pos = torch.arange(p, dtype=torch.float64)
        pr[:, m:] = BIG + pos[m:]
        stage1 = self.budget + self.prefill_ratio * (1.0 - self.budget)
        return release_to_count(ctx, pr, keep_count(stage1, p))

    # -- stage 2 --------------------------------------------------------------------------------
    def priority(self, scores: torch.Tensor, ctx: SeqContext, keep: int) -> torch.Tensor:
        """``[G, n]`` from ``step_scores [layers, 2, Hkv, n]``: tokens of the best pages, then token score."""
        groups = groups_of(ctx, scores.shape[0])
        n = ctx.length
        page = group_scores(scores[:, 0, :, :n], groups, self.head_reduce)
        token = group_scores(scores[:, 1, :, :n], groups, self.head_reduce)
        held = ctx.tiers() != R
        page = page.masked_fill(~held, -1.0)
        covered = int(self.page_factor * keep)
        order = torch.argsort(page, dim=-1, descending=True, stable=True)
        in_pages = torch.zeros_like(held)
        in_pages.scatter_(1, order[:, :covered], True)
        return token + BIG * in_pages.double()

    def step_actions(self, ctx: SeqContext) -> list[ActionSpec]:
        scores = need(ctx.step_scores, "step scores", self.name)
        keep = keep_count(self.budget, ctx.length)
        return release_to_count(ctx, self.priority(scores, ctx, keep), keep)
