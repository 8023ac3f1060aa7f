"""Screened sensitivity: run the Runtime-V probes only on cases the all-H control gets right.

V(q, a) is the accuracy drop of a probe against the control. A case the control gets wrong can
only move V down (a lucky gain), never reveal harm, so on a small machine the probes' case budget
is better spent on control-correct cases. :func:`screen_control_correct` picks ``probes`` of them
(the first cases of the seeded split order in each case group, e.g. BFCL category): one per group
with a control-correct case, the rest one at a time to the group whose flip currently weighs most
(D'Hondt, which keeps the largest weight, the resolution, as small as possible), and gives every
probed case the weight of its flip in the accuracy of the whole pool::

    V = sum over probed cases i of w_i * (control_i - probe_i),   w_i = k_g / (n * p_g)

with ``n`` pool cases, ``k_g`` control-correct and ``p_g`` probed cases in i's group ``g``: an
unbiased estimate of the pool's accuracy drop if no control-wrong case would turn right (gains are
not measured: an upper estimate of harm, like pooled layer groups). Unscreened
(:func:`screen_all`), every run case weighs ``1 / n`` and V is the plain accuracy difference.

``resolution`` is the largest single-flip weight: a tolerance finer than it cannot be measured.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pask.errors import PaskError


@dataclass(frozen=True)
class Screen:
    """The cases the sensitivity probes run and each one's weight in V."""

    weights: dict[str, float]  # probed case id -> weight of (control - probe) in V
    pool: int  # cases of the calibration split (schema errors included)
    screened: bool
    groups: dict[str, dict] | None = None  # per group: control-correct, probed, flip weight

    @property
    def case_ids(self) -> list[str]:
        return list(self.weights)

    @property
    def resolution(self) -> float:
        """The largest change of V one case can make."""
        return max(self.weights.values(), default=1.0)

    def v(self, control: Mapping[str, bool], probe: Mapping[str, bool]) -> float:
        """V from per-case correctness of the control and of one probe (ids missing from ``probe``:
        wrong)."""
        return sum(w * (int(control[i]) - int(probe.get(i, False))) for i, w in self.weights.items())


def screen_all(run_ids: list[str], pool: int) -> Screen:
    """No screening: every run case, weight ``1 / pool``."""
    return Screen({i: 1.0 / max(pool, 1) for i in run_ids}, pool, screened=False)


def screen_control_correct(correct: Mapping[str, bool], groups: Mapping[str, str], pool: int, probes: int) -> Screen:
    """``probes`` control-correct cases (at least one per group, at most all of them), allocated to
    groups in proportion to their control-correct counts; ``correct`` and ``groups`` map run case
    ids (in split order)."""
    if probes < 1:
        raise PaskError(f"--probe-cases must be >= 1, got {probes}")
    by_group: dict[str, list[str]] = {}
    for i, ok in correct.items():
        if ok:
            by_group.setdefault(groups[i], []).append(i)
    total = sum(len(v) for v in by_group.values())
    if total == 0:
        raise PaskError("the all-H control got no case right: sensitivity cannot be screened on correct cases")
    alloc = dict.fromkeys(by_group, 1)  # every group's right cases are represented
    for _ in range(min(probes, total) - len(alloc)):  # D'Hondt: the next probe to the heaviest flip
        g = max((g for g in by_group if alloc[g] < len(by_group[g])), key=lambda g: (len(by_group[g]) / alloc[g], g))
        alloc[g] += 1
    weights, summary = {}, {}
    for g, ids in by_group.items():
        w = len(ids) / (pool * alloc[g])
        weights.update(dict.fromkeys(ids[: alloc[g]], w))
        summary[g] = {"control_correct": len(ids), "probed": alloc[g], "weight": w}
    return Screen(weights, pool, screened=True, groups=summary)


__all__ = ["Screen", "screen_all", "screen_control_correct"]
