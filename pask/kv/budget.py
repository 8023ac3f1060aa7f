"""KV budget: the cost model of the actions and the budget measured on a TieredCache.

Cost model (per token, per layer, relative to keeping it in full precision):
``H = 1``, ``L = INT4 bytes (codes + bf16 scale/zero) / full-precision bytes``, ``L2 = INT2 bytes /
full-precision bytes`` (K4V2: the mean of its INT4 key and INT2 value bytes), ``R = 0``.

Measured budget: ``B = held bytes / bytes of the same tokens all kept H``, split into
``B_P`` (prompt tokens), ``B_D`` (generated tokens) and ``B`` (all). "Full precision" is the
dtype of the cache's H tier: BF16 for production models (fp32 in fp32 test runs, where the
same definitions hold with 4-byte values).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pask.errors import PaskError
from pask.kv.actions import Action
from pask.kv.quant import lowbit_bytes_per_vector


def check_budget(budget, name: str = "budget") -> float:
    """A target budget B as a float in (0, 1]; :class:`PaskError` "NAME must be in (0, 1], got X" otherwise.

    The one check of a budget given by a user: the CLI (``name="--budget"``), sweep configs and
    the policies' constructors all call it.
    """
    if isinstance(budget, bool):
        raise PaskError(f"{name} must be a number in (0, 1], got {budget!r}")
    try:
        b = float(budget)
    except (TypeError, ValueError):
        raise PaskError(f"{name} must be a number in (0, 1], got {budget!r}") from None
    if math.isnan(b) or not 0.0 < b <= 1.0:
        raise PaskError(f"{name} must be in (0, 1], got {budget}")
    return b


@dataclass(frozen=True)
class CostModel:
    """Relative cost of H / L (INT4) / L2 (INT2) / R for vectors of ``head_dim`` values in ``dtype``."""

    head_dim: int = 64
    quant_group: int = 32
    dtype: torch.dtype = torch.bfloat16
    l2_key_bits: int = 2  # 4: the L2 tier is K4V2 (INT4 keys, INT2 values; CacheConfig.l2_key_bits)

    @property
    def full_bytes_per_vector(self) -> int:
        return self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    @property
    def l_ratio(self) -> float:
        """L (INT4) cost: 0.3125 over BF16 at D=64, group 32."""
        return lowbit_bytes_per_vector(self.head_dim, self.quant_group, 4) / self.full_bytes_per_vector

    @property
    def l2_ratio(self) -> float:
        """L2 cost: 0.1875 over BF16 at D=64, group 32 (INT2 keys and values); 0.25 for K4V2 (the mean of
        an INT4 key and an INT2 value vector)."""
        k = lowbit_bytes_per_vector(self.head_dim, self.quant_group, self.l2_key_bits)
        v = lowbit_bytes_per_vector(self.head_dim, self.quant_group, 2)
        return (k + v) / 2 / self.full_bytes_per_vector

    def cost(self, action: Action) -> float:
        a = Action(int(action))
        return {Action.H: 1.0, Action.L: self.l_ratio, Action.L2: self.l2_ratio, Action.R: 0.0}[a]

    def mix_cost(self, h: float, l: float, r: float, l2: float = 0.0) -> float:  # noqa: E741
        """Expected relative bytes of a mix of H / L / R / L2 fractions."""
        return h * 1.0 + l * self.l_ratio + l2 * self.l2_ratio + r * 0.0

    def predict(self, counts: Sequence[int]) -> float:
        """Relative bytes of (nH, nL, nR[, nL2]) tokens (indexed by :class:`Action` value)."""
        n = sum(counts)
        l2 = counts[3] if len(counts) > 3 else 0
        return 0.0 if n == 0 else (counts[0] + counts[1] * self.l_ratio + l2 * self.l2_ratio) / n


@dataclass
class Budget:
    """Budget measured on a cache: ratios of held bytes to full-precision bytes."""

    b_prompt: float
    b_decode: float
    b_total: float
    b_total_avg: float  # mean of b_total over the recorded decode steps (b_total if none)
    held_bytes: int  # live K/V bytes held now by live sequences
    full_bytes: int  # full-precision bytes of the same live tokens
    samples: int = 0


def _ratio(a: int, b: int) -> float:
    return a / b if b else 0.0


@dataclass
class BudgetMeter:
    """Records one B sample per decode step; builds :class:`Budget` from the cache's tensors."""

    history: list[float] = field(default_factory=list)

    def current(self, cache) -> tuple[float, float, float]:
        held, full = cache.budget_bytes()
        return _ratio(held[0], full[0]), _ratio(held[1], full[1]), _ratio(sum(held), sum(full))

    def sample(self, cache) -> float:
        b = self.current(cache)[2]
        self.history.append(b)
        return b

    def budget(self, cache) -> Budget:
        bp, bd, bt = self.current(cache)
        avg = sum(self.history) / len(self.history) if self.history else bt
        _, live_full = cache.budget_bytes(live_only=True)
        return Budget(
            b_prompt=bp,
            b_decode=bd,
            b_total=bt,
            b_total_avg=avg,
            held_bytes=cache.held_bytes(),
            full_bytes=sum(live_full),
            samples=len(self.history),
        )
