"""SnapKV: the observation window's pooled attention picks the prompt tokens to keep (prefill only)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from pask.policies._common import (
    BIG,
    PromptRanked,
    check_budget,
    check_window_scorer,
    group_scores,
    groups_of,
    need,
    pool1d,
)
from pask.policies.base import SeqContext

POOLINGS = ("avg", "max")


def window_scores(att: torch.Tensor, prompt_len: int, window: int, kernel: int, pooling: str) -> torch.Tensor:
    """SnapKV's per (layer, kv head) scores of the prefix ``[0, P - w)``: window attention, pooled.

    ``att [layers, Hkv, P]`` is the window queries' attention summed over the queries (and averaged
    over each kv head's query heads); the result is the mean over the window's queries, pooled.
    """
    w = min(window, prompt_len)
    return pool1d(att[..., : prompt_len - w] / max(w, 1), kernel, pooling)


@dataclass
class SnapKVPolicy(PromptRanked):
    """SnapKV: LLM knows what you are looking for before generation (Li et al., NeurIPS 2024).

    The last ``window`` prompt queries (the observation window) vote for the prefix tokens: their
    attention to each prefix key, averaged over the window, is smoothed by a 1-D pooling of size
    ``kernel`` along the sequence, and the best-scored prefix tokens are kept together with the
    window itself; the rest of the prompt is released once, at prefill. Generated tokens are kept.

    Budget: at prefill ``round(budget · P)`` prompt tokens are kept. Generated tokens then arrive
    in H, so after every step the lowest-ranked kept prompt tokens (the same prefill ranking) are
    released until ``round(budget · n)`` tokens are held: the kept prompt set is always a prefix of
    the prefill ranking and the measured B stays at the target. If the prompt runs out (a generation
    longer than about ``P · budget / (1 - budget)``), the oldest generated tokens go.

    Parameters
    ----------
    budget : float
        Target measured budget B in (0, 1].
    window : int, default=32
        Observation window: the last prompt queries that vote (Table 8: {16, 32, 64, 128}); the
        window's own tokens are kept first.
    kernel : int, default=5
        Pooling kernel along the sequence, odd (Table 8: {3, 5, 7}); 1 disables pooling.
    pooling : {"avg", "max"}, default="avg"
        Pooling type (Table 8).
    head_reduce : {"sum", "max", "mean"}, default="sum"
        How the scores of the (layer, kv head) pairs of a layer group are combined.

    Notes
    -----
    Deviation: SnapKV keeps top-k per head; here the heads and layers of a group share one
    selection (one action per token and group). Query heads of a kv head are averaged (as kvpress
    does for GQA).
    """

    budget: float
    window: int = 32
    kernel: int = 5
    pooling: str = "avg"
    head_reduce: str = "sum"

    name: ClassVar[str] = "snapkv"
    _prio: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.budget = check_budget(self.budget, self.name)
        check_window_scorer(self, POOLINGS)

    def prompt_priority(self, ctx: SeqContext) -> torch.Tensor:
        """``[G, P]``: the window (newest first) above the pooled prefix scores."""
        att = need(ctx.prefill_attention, "prefill attention", self.name)
        p = ctx.prompt_len
        scores = window_scores(att, p, self.window, self.kernel, self.pooling)
        pr = torch.full((len(groups_of(ctx, att.shape[0])), p), 0.0, dtype=torch.float64)
        pr[:, : scores.shape[-1]] = group_scores(scores, groups_of(ctx, att.shape[0]), self.head_reduce)
        pos = torch.arange(p, dtype=torch.float64)
        win = pos >= scores.shape[-1]
        pr[:, win] = BIG + pos[win]
        return pr
