"""H2O: heavy hitters (accumulated attention) + attention sinks + recent tokens, evicted as decoding goes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from pask.policies._common import (
    BIG,
    REDUCES,
    AttentionAccumulating,
    check_budget,
    check_choice,
    check_int,
    group_scores,
    groups_of,
    keep_count,
    release_to_count,
)
from pask.policies.base import ActionSpec, SeqContext


@dataclass
class H2OPolicy(AttentionAccumulating):
    """H2O: Heavy-Hitter Oracle for efficient generative inference (Zhang et al., NeurIPS 2023).

    Every token's accumulated attention (the column sums of the attention of all queries seen so
    far: every prompt query at prefill, then each generated query) ranks the "heavy hitters". The
    cache holds the first ``sink`` tokens, the last ``recent`` tokens and the heaviest hitters,
    ``round(budget · n)`` tokens in all, and evicts (releases) the rest; after every decode step it
    re-plans with the new query's attention added, so a cooled-down heavy hitter can be evicted.

    Parameters
    ----------
    budget : float
        Target measured budget B in (0, 1] (held bytes / Full-KV bytes).
    sink : int, default=4
        First tokens always kept (attention sinks; Table 8: {2, 4, 8}).
    recent : int, default=32
        Last tokens always kept (H2O's recent share; Table 8: {16, 32, 64, 128}). The cache's own
        recent window is kept regardless. When sink + recent exceed the budget, the oldest of the
        recent tokens go first, then the sinks.
    head_reduce : {"sum", "max", "mean"}, default="sum"
        How the per (layer, kv head) accumulations of a layer group are combined (one action per
        token and group; see :mod:`pask.policies._common`).

    Notes
    -----
    Deviation: H2O selects per head; here the heads and layers of a group share one selection.
    Attention is averaged over the query heads that share a kv head.
    """

    budget: float
    sink: int = 4
    recent: int = 32
    head_reduce: str = "sum"

    name: ClassVar[str] = "h2o"
    _acc: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.budget = check_budget(self.budget, self.name)
        check_int(self.sink, 0, "sink", self.name)
        check_int(self.recent, 0, "recent", self.name)
        check_choice(self.head_reduce, REDUCES, "head_reduce", self.name)

    def priority(self, acc: torch.Tensor, ctx: SeqContext) -> torch.Tensor:
        """``[G, n]``: sinks, then recent tokens (newest first), then accumulated attention."""
        n = ctx.length
        pr = group_scores(acc[..., :n], groups_of(ctx, acc.shape[0]), self.head_reduce)
        pos = torch.arange(n, dtype=torch.float64)
        pr[:, pos >= n - self.recent] = BIG + pos[pos >= n - self.recent]
        pr[:, pos < self.sink] = 2 * BIG - pos[pos < self.sink]
        return pr

    def ranking(self, ctx: SeqContext) -> torch.Tensor | None:
        """The heavy-hitter priority of the row (None before its prefill)."""
        acc = self._acc.get(ctx.seq)
        return None if acc is None else self.priority(acc, ctx)

    def _plan(self, ctx: SeqContext) -> list[ActionSpec]:
        pr = self.priority(self._acc[ctx.seq], ctx)
        return release_to_count(ctx, pr, keep_count(self.budget, ctx.length))
