"""The table solver: protection floors from task sensitivity, then greedy upgrades by distortion.

Inputs, per bucket ``q`` (a structure item in one layer group):

- ``weight`` w_q: the expected share of a case's KV bytes that the bucket's tokens hold when
  kept H: (mean over cases of the bucket item's tokens outside the final recent window / all
  stored tokens of the case) x (layers in the group / all layers).
- ``v[a]``: task sensitivity V(q, a) for a in {L, L2, R}: accuracy drop (fraction, 0.05 = 5 pp) of
  the all-H run when only ``q`` gets ``a``. Missing = not measured = +inf.
- ``d[a]``: attention-output distortion D(q, a) (relative L2). Missing = +inf.
- ``stage``: ``"P"`` (prompt bucket, tolerance alpha_P) or ``"D"`` (decode bucket, alpha_D).

``base_b`` is the cost of everything outside the buckets: tokens in the recent window (always
H) plus tokens of unmeasured buckets at the table's default action. The expected budget of a
table is ``B = base_b + sum_q w_q * cost(action_q)`` with cost H = 1, L (INT4) = ``l_cost`` (0.3125),
L2 (INT2) = ``l2_cost`` (0.1875), R = 0 -- the same cost model the cache measures.

Rules (exact):

1. Monotone envelope over harm ``H <= L <= L2 <= R`` (release at least as harmful as INT2, INT2
   at least as harmful as INT4): ``Veff(q, H) = 0``, ``Veff(q, L) = V(q, L)``,
   ``Veff(q, L2) = max(V(q, L2), V(q, L))``, ``Veff(q, R) = max(V(q, R), Veff(q, L2))``. Distortion
   gets the same envelope. An unmeasured L2 (a three-action calibration: ``v`` has no ``"L2"``)
   is +inf for L2 itself -- never chosen -- but does not raise R's envelope, so a three-action
   input solves exactly as it did before INT2 existed. An unmeasured L or R is +inf and, for L,
   raises everything more harmful.
   ``envelope="branch"`` (not the paper's chain; see ``docs/calibration.md``): INT2 and release are
   each at least as harmful as INT4 but not ordered between themselves,
   ``Veff(q, L2) = max(V(q, L2), V(q, L))``, ``Veff(q, R) = max(V(q, R), V(q, L))``. Measured INT2
   is often more harmful than release (2-bit keys add spurious attention; a released token is
   simply absent), and the chain then charges release with INT2's harm.
2. Floor: the cheapest action ``a`` with ``Veff(q, a) <= alpha`` (alpha = alpha_P for prompt
   buckets, alpha_D for decode buckets). By (1) the allowed actions are "floor and every measured
   action dearer", so R allowed implies L allowed (and L2, when measured).
3. Start from the floor table. If its B already exceeds ``target_b``, the target is infeasible
   under the tolerances: the floor table is returned with ``feasible = False`` (the floors are
   never broken to meet a budget) and ``needs`` gives, per stage, the smallest tolerance of that
   stage (the other kept) under which the floors fit the target (None: no tolerance does).
4. Otherwise upgrade greedily while B stays <= ``target_b``: among every single upgrade of one
   bucket from its current action to a dearer one along ``R -> L2 -> L -> H`` (any jump, e.g.
   R->L or L2->H) whose added cost
   ``w_q * (cost(new) - cost(cur))`` still fits, take the one with the largest distortion
   reduction per unit cost ``(Deff(q, cur) - Deff(q, new)) / added cost``; ties go to the larger
   reduction, then to the smaller bucket name. Only upgrades that reduce distortion
   (``gain > 0``) and never raise the effective sensitivity (``Veff(q, new) <= max(Veff(q, cur), 0)``;
   always true in the chain; a negative V is a measured gain, noise nobody protects) are taken.
   Stop when no upgrade fits. ``target_b`` is an upper bound: the
   result may spend less when nothing else reduces distortion or fits.
5. ``fit="sensitivity"`` (not the paper's rule; for budgets below the floors, see
   ``docs/calibration.md``): an infeasible floor table is instead relaxed one bucket at a time,
   cheapest in accuracy first, until it fits. Each step moves one bucket from its current action to
   a cheaper measured one (any jump along ``H -> L -> L2 -> R``) and takes the move with the
   smallest added effective sensitivity per byte saved,
   ``(Veff(q, new) - Veff(q, cur)) / (w_q * (cost(cur) - cost(new)))``; ties go to the smaller
   added distortion per byte (with pooled calibration every group of an item has the same V, so
   distortion picks the groups), then to the bucket name. Rule 4 then spends what is left. The
   result records every relaxation (``relaxed``) and the largest effective V it admits per stage
   (``admitted``); ``feasible`` stays false (the nominal tolerances are not met) and ``fitted`` is
   true when the target is reached (false when even the cheapest measured actions exceed it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

L_COST = 0.3125
L2_COST = 0.1875
ORDER = ("R", "L2", "L", "H")  # cheapest first
ENVELOPES = ("chain", "branch")  # release >= INT2 >= INT4 in harm, or release and INT2 each >= INT4 (rule 1)
FITS = ("floors", "sensitivity")  # what an infeasible target does: keep the floors, or relax them (rule 5)


@dataclass(frozen=True)
class BucketInput:
    """One calibrated bucket (see the module docstring)."""

    bucket: str
    stage: str  # "P" | "D"
    weight: float
    v: dict[str, float] = field(default_factory=dict)
    d: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.stage not in ("P", "D"):
            raise ValueError(f"stage must be 'P' or 'D', got {self.stage!r}")
        if not self.weight >= 0:
            raise ValueError(f"weight must be >= 0, got {self.weight}")


@dataclass
class Solution:
    """Solver result: actions per bucket, floors, budgets and the upgrade trace."""

    actions: dict[str, str]
    floors: dict[str, str]
    expected_b: float
    floor_b: float
    target_b: float
    feasible: bool
    v_eff: dict[str, dict[str, float]]
    d_eff: dict[str, dict[str, float]]
    upgrades: list[dict] = field(default_factory=list)  # in the order taken
    needs: dict[str, float | None] = field(default_factory=dict)  # infeasible: {"alpha_p": .., "alpha_d": ..}
    fitted: bool = False  # rule 5 reached the target by relaxing floors
    relaxed: list[dict] = field(default_factory=list)  # rule 5's moves, in the order taken
    admitted: dict[str, float] = field(default_factory=dict)  # largest Veff of the chosen actions per stage

    def summary(self) -> str:
        n = {a: sum(x == a for x in self.actions.values()) for a in ORDER}
        state = "feasible" if self.feasible else "INFEASIBLE: the floors alone exceed the target"
        if self.needs:
            fits = [f"{k} >= {v:.4f}" for k, v in self.needs.items() if v is not None]
            state += "; it fits with " + (" or ".join(fits) if fits else "no tolerance of one stage")
        if self.relaxed:
            adm = ", ".join(f"{k} {v:.4f}" for k, v in sorted(self.admitted.items()))
            state += (
                f"; FITTED by relaxing {len(self.relaxed)} floors, cheapest accuracy per byte first "
                f"(largest admitted V: {adm})"
                if self.fitted
                else f"; relaxing {len(self.relaxed)} floors to the cheapest measured actions still does not fit"
            )
        return (
            f"target B {self.target_b:.4f}, floors B {self.floor_b:.4f}, expected B {self.expected_b:.4f} ({state}); "
            f"buckets H/L/L2/R = {n['H']}/{n['L']}/{n['L2']}/{n['R']}, {len(self.upgrades)} upgrades"
        )


def cost(action: str, l_cost: float = L_COST, l2_cost: float = L2_COST) -> float:
    """Bytes of ``action`` as a share of H's."""
    return {"H": 1.0, "L": l_cost, "L2": l2_cost, "R": 0.0}[action]


def _num(x: float | None) -> float:
    return math.inf if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def envelope(values: dict[str, float], kind: str = "chain") -> dict[str, float]:
    """Monotone envelope over H <= L <= L2 <= R, or H <= L <= {L2, R} (rule 1 of the module docstring)."""
    if kind not in ENVELOPES:
        raise ValueError(f"envelope must be one of {ENVELOPES}, got {kind!r}")
    lv = _num(values.get("L"))
    if "L2" in values:
        l2 = max(_num(values["L2"]), lv)
        return {"H": 0.0, "L": lv, "L2": l2, "R": max(_num(values.get("R")), l2 if kind == "chain" else lv)}
    return {"H": 0.0, "L": lv, "L2": math.inf, "R": max(_num(values.get("R")), lv)}


def floor_action(v_eff: dict[str, float], alpha: float) -> str:
    """Cheapest action whose effective sensitivity is within the tolerance (H always is)."""
    for a in ORDER:
        if v_eff.get(a, math.inf) <= alpha:
            return a
    return "H"


def expected_b(
    actions: dict[str, str],
    buckets: Iterable[BucketInput],
    base_b: float = 0.0,
    l_cost: float = L_COST,
    l2_cost: float = L2_COST,
) -> float:
    """``base_b + sum_q w_q * cost(action_q)``."""
    return base_b + sum(b.weight * cost(actions[b.bucket], l_cost, l2_cost) for b in buckets)


def solve(
    buckets: list[BucketInput],
    target_b: float,
    alpha_d: float = 0.05,
    alpha_p: float = 0.02,
    base_b: float = 0.0,
    l_cost: float = L_COST,
    l2_cost: float = L2_COST,
    fit: str = "floors",
    envelope_kind: str = "chain",
) -> Solution:
    """Floors from sensitivity, then greedy distortion-per-cost upgrades under ``target_b``.

    ``fit``: ``"floors"`` (the paper: an infeasible target returns the floor table) or
    ``"sensitivity"`` (rule 5: relax floors, cheapest accuracy per byte first, until it fits).
    ``envelope_kind``: ``"chain"`` (the paper's order) or ``"branch"`` (rule 1).
    """
    if fit not in FITS:
        raise ValueError(f"fit must be one of {FITS}, got {fit!r}")
    names = [b.bucket for b in buckets]
    if len(set(names)) != len(names):
        raise ValueError("duplicate bucket names")
    v_eff = {b.bucket: envelope(b.v, envelope_kind) for b in buckets}
    d_eff = {b.bucket: envelope(b.d, envelope_kind) for b in buckets}
    floors = {b.bucket: floor_action(v_eff[b.bucket], alpha_p if b.stage == "P" else alpha_d) for b in buckets}
    actions = dict(floors)
    floor_b = expected_b(actions, buckets, base_b, l_cost, l2_cost)
    sol = Solution(actions, floors, floor_b, floor_b, target_b, floor_b <= target_b + 1e-12, v_eff, d_eff)
    if not sol.feasible:
        sol.needs = {
            "alpha_p": _needed(buckets, v_eff, "P", alpha_p, alpha_d, target_b, base_b, (l_cost, l2_cost)),
            "alpha_d": _needed(buckets, v_eff, "D", alpha_p, alpha_d, target_b, base_b, (l_cost, l2_cost)),
        }
        if fit == "floors":
            return sol
        sol.fitted = _relax(buckets, actions, v_eff, d_eff, target_b, floor_b, (l_cost, l2_cost), sol.relaxed)
        if not sol.fitted:
            sol.expected_b = expected_b(actions, buckets, base_b, l_cost, l2_cost)
            sol.admitted = _admitted(buckets, actions, v_eff)
            return sol
    b_now = expected_b(actions, buckets, base_b, l_cost, l2_cost)
    eps = 1e-12
    while True:
        moves = []
        for b in buckets:
            cur = actions[b.bucket]
            for new in ORDER[ORDER.index(cur) + 1 :]:
                added = b.weight * (cost(new, l_cost, l2_cost) - cost(cur, l_cost, l2_cost))
                gain = d_eff[b.bucket][cur] - d_eff[b.bucket][new]
                riskier = v_eff[b.bucket][new] > max(v_eff[b.bucket][cur], 0.0)
                if b_now + added > target_b + eps or not gain > 0 or riskier:
                    continue
                ratio = gain / added if added > 0 else math.inf
                moves.append((-ratio, -gain, b.bucket, new, added))
        if not moves:
            break
        neg_ratio, neg_gain, name, new, added = min(moves)
        cur = actions[name]
        actions[name] = new
        b_now += added
        sol.upgrades.append(
            {
                "bucket": name,
                "from": cur,
                "to": new,
                "gain": -neg_gain,
                "added_b": added,
                "ratio": -neg_ratio,
                "b": b_now,
            }
        )
    sol.expected_b = expected_b(actions, buckets, base_b, l_cost, l2_cost)
    if sol.relaxed:
        sol.admitted = _admitted(buckets, actions, v_eff)
    return sol


def _per_byte(delta: float, saved: float) -> float:
    """``delta / saved`` with unmeasured (inf or nan) deltas last."""
    return delta / saved if math.isfinite(delta) else math.inf


def _relax(buckets, actions, v_eff, d_eff, target_b, b_now, costs, trace) -> bool:
    """Rule 5: move buckets to cheaper measured actions, least added V per byte first, until ``target_b``."""
    eps = 1e-12
    while b_now > target_b + eps:
        moves = []
        for b in buckets:
            cur = actions[b.bucket]
            for new in ORDER[: ORDER.index(cur)]:
                saved = b.weight * (cost(cur, *costs) - cost(new, *costs))
                if not saved > 0 or not math.isfinite(v_eff[b.bucket][new]):
                    continue
                dv = v_eff[b.bucket][new] - v_eff[b.bucket][cur]
                dd = d_eff[b.bucket][new] - d_eff[b.bucket][cur]
                moves.append((_per_byte(dv, saved), _per_byte(dd, saved), b.bucket, ORDER.index(new), new, saved, dv))
        if not moves:
            return False
        *_, name, _, new, saved, dv = min(moves)
        trace.append({"bucket": name, "from": actions[name], "to": new, "added_v": dv, "saved_b": saved})
        actions[name] = new
        b_now -= saved
        trace[-1]["b"] = b_now
    return True


def _admitted(buckets, actions, v_eff) -> dict[str, float]:
    """The largest effective V of the chosen actions, per stage (``P`` / ``D``)."""
    out: dict[str, float] = {}
    for b in buckets:
        out[b.stage] = max(out.get(b.stage, 0.0), v_eff[b.bucket][actions[b.bucket]])
    return out


def _needed(buckets, v_eff, stage, alpha_p, alpha_d, target_b, base_b, costs) -> float | None:
    """The smallest tolerance of ``stage`` (the other stage's kept) whose floor table fits ``target_b``."""
    cands = sorted({v for b in buckets if b.stage == stage for v in v_eff[b.bucket].values() if math.isfinite(v)})
    for alpha in cands:
        a_p, a_d = (alpha, alpha_d) if stage == "P" else (alpha_p, alpha)
        floors = {b.bucket: floor_action(v_eff[b.bucket], a_p if b.stage == "P" else a_d) for b in buckets}
        if expected_b(floors, buckets, base_b, *costs) <= target_b + 1e-12:
            return alpha
    return None
