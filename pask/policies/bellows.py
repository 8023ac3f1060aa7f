"""BellowsKV: one shared latent per block of adjacent layers (Quant), optionally with one eviction
decision per token per block (Evict). The tier itself is :mod:`pask.kv.latent`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from pask.errors import PaskError
from pask.kv.actions import Action
from pask.kv.latent import LATENT_BITS, LatentProjections, LatentSpec, load
from pask.policies._common import check_budget
from pask.policies.base import ActionSpec, PolicyBase, SeqContext
from pask.policies.snapkv import SnapKVPolicy

#: How far a ``bellows`` budget label may sit from the latent's own ratio.
BUDGET_SLACK = 0.03


def _projections(value) -> LatentProjections:
    if isinstance(value, LatentProjections):
        return value
    if not isinstance(value, str) or not value:
        raise PaskError("bellows: 'projections' must be the path of a `pask calibrate-bellows` file")
    return load(value)


def _to_latent(ctx: SeqContext, releases: list[ActionSpec] = ()) -> list[ActionSpec]:
    """Every held H token outside the recent window, in every block, to the block's latent (L),
    except those ``releases`` (actions applied before these) release."""
    limit = ctx.length - ctx.recent_window
    if limit <= 0:
        return []
    tiers = ctx.tiers()[:, :limit].clone()
    for g, pos, action in releases:
        if action == Action.R:
            tiers[g, pos[pos < limit]] = int(Action.R)
    out: list[ActionSpec] = []
    for g in range(tiers.shape[0]):
        pos = torch.nonzero(tiers[g] == int(Action.H)).squeeze(1)
        if pos.numel():
            out.append((g, pos, Action.L))
    return out


@dataclass
class BellowsPolicy(PolicyBase):
    """BellowsKV-Quant: every token outside the recent window keeps only its block's latent.

    The recent window stays exact per layer (BF16 K/V); older tokens are read through each layer's
    projection of the block's latent (:mod:`pask.kv.latent`), stored at ``bits`` (16: BF16; 8 / 4
    / 2: codes with a bf16 scale and zero per 32 values). Nothing is released, so the measured B
    follows from ``n`` and ``bits`` (about the latent's bytes over its block's K/V bytes, plus the
    window): the policy has no budget target.

    Parameters
    ----------
    projections : str or LatentProjections
        A ``pask calibrate-bellows`` file (its ``n`` and latent choice come with it).
    bits : int, default=4
        Width of the stored latent: 16, 8, 4 or 2.
    budget : float, optional
        The B the caller expects (a sweep's cell label): checked against the latent's ratio
        (within :data:`BUDGET_SLACK`), since ``n`` and ``bits`` fix B; ``None``: not checked.
    dim : int, optional
        A ``"pca"`` latent cut to its ``dim`` leading principal directions (fewer bytes per token).
    """

    projections: str | LatentProjections
    bits: int = 4
    budget: float | None = None
    dim: int | None = None

    name: ClassVar[str] = "bellows"

    def __post_init__(self) -> None:
        if self.bits not in LATENT_BITS or isinstance(self.bits, bool):
            raise PaskError(f"bellows: bits must be one of {', '.join(map(str, LATENT_BITS))}, got {self.bits!r}")
        self.projections = _projections(self.projections)
        if self.dim is not None:
            self.projections = self.projections.truncated(self.dim)
        self.latent = LatentSpec(self.projections, self.bits)
        if self.budget is not None:
            self.budget = check_budget(self.budget, self.name)
            ratio = self.latent.ratio()
            if abs(self.budget - ratio) > BUDGET_SLACK:
                raise PaskError(
                    f"bellows: n = {self.projections.n} with {self.bits}-bit latents holds B = {ratio:.3f} (plus the "
                    f"recent window), not {self.budget}: choose n (`pask calibrate-bellows --n`) and bits for that "
                    "B, or bellows-evict for a B below the latent's ratio"
                )

    @property
    def target_b(self) -> float:
        """``budget`` if given, else the latent's share of its block's Full-KV bytes (the window not counted)."""
        return self.latent.ratio() if self.budget is None else float(self.budget)

    def prefill_actions(self, ctx: SeqContext) -> list[ActionSpec]:
        return _to_latent(ctx)

    def step_actions(self, ctx: SeqContext) -> list[ActionSpec]:
        return _to_latent(ctx)


@dataclass
class BellowsEvictPolicy(PolicyBase):
    """BellowsKV-Evict: BF16 latents (``bits``, default 16) and one SnapKV eviction decision per
    token per block (the blocks are the cache's layer groups, so SnapKV's per-group selection is
    the per-block decision), holding ``budget / ratio`` of the tokens, ranked as SnapKV ranks them
    (generated tokens above the prompt), so that the measured B lands near ``budget`` (``ratio``:
    a latent's bytes over its block's K/V bytes).

    Parameters
    ----------
    budget : float
        Target measured budget B; must be below ``ratio`` (a larger B keeps every latent: use ``bellows``).
    projections, bits
        As for :class:`BellowsPolicy`.
    window, kernel, pooling : SnapKV's observation window, pooling kernel and pooling type.
    """

    budget: float
    projections: str | LatentProjections
    bits: int = 16
    window: int = 32
    kernel: int = 5
    pooling: str = "avg"

    name: ClassVar[str] = "bellows-evict"
    _inner: SnapKVPolicy = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.budget = check_budget(self.budget, self.name)
        if self.bits not in LATENT_BITS or isinstance(self.bits, bool):
            raise PaskError(f"bellows-evict: bits must be one of {', '.join(map(str, LATENT_BITS))}, got {self.bits!r}")
        self.projections = _projections(self.projections)
        self.latent = LatentSpec(self.projections, self.bits)
        ratio = self.latent.ratio()
        if self.budget >= ratio:
            raise PaskError(
                f"bellows-evict: budget {self.budget} is not below the latent's own ratio {ratio:.3f} "
                f"(n = {self.projections.n}, {self.bits}-bit): nothing would be evicted; use policy 'bellows'"
            )
        self._inner = SnapKVPolicy(self.budget / ratio, self.window, self.kernel, self.pooling)

    @property
    def prefill_window(self) -> int:  # type: ignore[override]
        return self._inner.prefill_window

    def reset(self, seq: int) -> None:
        self._inner.reset(seq)

    def ranking(self, ctx: SeqContext) -> torch.Tensor | None:
        return self._inner.ranking(ctx)

    def prefill_actions(self, ctx: SeqContext) -> list[ActionSpec]:
        releases = self._inner.prefill_actions(ctx)
        return [*releases, *_to_latent(ctx, releases)]

    def step_actions(self, ctx: SeqContext) -> list[ActionSpec]:
        releases = self._inner.step_actions(ctx)
        return [*releases, *_to_latent(ctx, releases)]
