"""The table solver on synthetic buckets: envelope, floors, budget, greedy order."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pask.calibration.solver import ORDER, BucketInput, cost, envelope, expected_b, floor_action, solve


def B(name, stage="D", w=0.1, vl=0.0, vr=0.0, dl=0.01, dr=0.1):
    return BucketInput(name, stage, w, v={"L": vl, "R": vr}, d={"L": dl, "R": dr})


def B4(name, stage="D", w=0.1, vl=0.0, vl2=0.0, vr=0.0, dl=0.01, dl2=0.05, dr=0.1):
    return BucketInput(name, stage, w, v={"L": vl, "L2": vl2, "R": vr}, d={"L": dl, "L2": dl2, "R": dr})


def test_monotone_envelope():
    inf = math.inf
    assert envelope({"L": 0.03, "R": 0.01}) == {"H": 0.0, "L": 0.03, "L2": inf, "R": 0.03}
    assert envelope({"L": 0.01, "R": 0.04}) == {"H": 0.0, "L": 0.01, "L2": inf, "R": 0.04}
    assert envelope({}) == {"H": 0.0, "L": inf, "L2": inf, "R": inf}  # unmeasured = never allowed
    assert envelope({"L": 0.2})["R"] == inf  # R unmeasured stays forbidden


def test_four_action_envelope_chains_l_l2_r():
    assert envelope({"L": 0.01, "L2": 0.03, "R": 0.02}) == {"H": 0.0, "L": 0.01, "L2": 0.03, "R": 0.03}
    assert envelope({"L": 0.04, "L2": 0.0, "R": 0.0}) == {"H": 0.0, "L": 0.04, "L2": 0.04, "R": 0.04}
    # L2 measured but R not: R stays forbidden; L2 unmeasured (three actions) leaves R at max(V(R), V(L))
    assert envelope({"L": 0.0, "L2": 0.01})["R"] == math.inf
    assert envelope({"L": 0.0, "R": 0.01})["R"] == 0.01


def test_l2_floor_between_l_and_r():
    sol = solve([B4("q", vl=0.0, vl2=0.03, vr=0.2)], target_b=1.0)
    assert sol.floors["q"] == "L2"  # R breaks the tolerance, INT2 does not
    sol = solve([B4("q", stage="P", vl=0.0, vl2=0.03, vr=0.2)], target_b=1.0)
    assert sol.floors["q"] == "L"  # 3 pp > alpha_P


def test_l2_upgrade_ranked_by_distortion_per_byte():
    # floors R; the cheap R->L2 step (cost 0.1875 w) removes most of the distortion
    sol = solve([B4("q", w=0.4, dl=0.01, dl2=0.02, dr=0.5)], target_b=0.08)
    assert sol.actions == {"q": "L2"} and sol.expected_b == pytest.approx(0.4 * 0.1875)
    assert [(u["from"], u["to"]) for u in sol.upgrades] == [("R", "L2")]
    # more budget: the next step L2->L is taken too (R->L directly has a lower ratio than R->L2)
    sol = solve([B4("q", w=0.4, dl=0.01, dl2=0.02, dr=0.5)], target_b=0.13)
    assert sol.actions == {"q": "L"}
    assert [(u["from"], u["to"]) for u in sol.upgrades] == [("R", "L2"), ("L2", "L")]


def test_three_action_inputs_solve_as_before():
    buckets = [B("a", w=0.3, dl=0.01, dr=0.4), B("b", w=0.2, vr=0.1, dl=0.02, dr=0.3)]
    sol = solve(buckets, target_b=0.2)
    assert "L2" not in sol.actions.values() and "L2" not in sol.floors.values()
    assert all(u["to"] != "L2" for u in sol.upgrades)
    assert sol.floors == {"a": "R", "b": "L"}


def test_expected_b_counts_l2_cost():
    buckets = [B("a", w=0.5), B("b", w=0.3)]
    assert expected_b({"a": "L2", "b": "R"}, buckets) == pytest.approx(0.5 * 0.1875)
    assert expected_b({"a": "L2", "b": "L2"}, buckets, l2_cost=0.1) == pytest.approx(0.08)
    assert cost("L2") == 0.1875 and cost("L2", l2_cost=0.25) == 0.25


def test_floor_is_cheapest_allowed_action():
    assert floor_action({"H": 0, "L": 0.01, "R": 0.02}, 0.05) == "R"
    assert floor_action({"H": 0, "L": 0.01, "R": 0.06}, 0.05) == "L"
    assert floor_action({"H": 0, "L": 0.06, "R": 0.06}, 0.05) == "H"


def test_envelope_makes_r_floor_respect_l_sensitivity():
    # V(R) alone is small but V(L) is large: the envelope forbids R too
    sol = solve([B("q", vl=0.10, vr=0.0)], target_b=1.0)
    assert sol.floors["q"] == "H"
    assert sol.v_eff["q"]["R"] == pytest.approx(0.10)


def test_stage_tolerances():
    buckets = [B("p", stage="P", vl=0.03, vr=0.03), B("d", stage="D", vl=0.03, vr=0.03)]
    sol = solve(buckets, target_b=0.0)
    assert sol.floors == {"p": "H", "d": "R"}  # 3 pp > alpha_P = 2 pp, <= alpha_D = 5 pp


def test_infeasible_returns_floor_table():
    buckets = [B("a", w=0.5, vl=0.5, vr=0.5), B("b", w=0.5)]
    sol = solve(buckets, target_b=0.3)
    assert not sol.feasible
    assert sol.actions == sol.floors == {"a": "H", "b": "R"}
    assert sol.expected_b == pytest.approx(0.5) and sol.upgrades == []
    assert sol.needs == {"alpha_p": None, "alpha_d": 0.5}  # only tolerating a's 50 pp drop fits
    assert "fits with alpha_d >= 0.5000" in sol.summary()


def test_infeasible_names_the_smallest_tolerance_that_fits():
    buckets = [
        B("p1", stage="P", w=0.4, vl=0.03, vr=0.08),  # L needs alpha_P >= 3 pp, R >= 8 pp
        B("p2", stage="P", w=0.2, vl=0.01, vr=0.06),
        B("d", stage="D", w=0.2, vl=0.5, vr=0.5),  # never cheaper within alpha_D
    ]
    sol = solve(buckets, target_b=0.35)  # floors H, L, H: 0.4 + 0.0625 + 0.2
    assert not sol.feasible
    # alpha_P = 0.03: p1 L, p2 L -> 0.125 + 0.0625 + 0.2 = 0.3875 > 0.35; 0.06: p2 R -> 0.325 fits
    assert sol.needs["alpha_p"] == pytest.approx(0.06) and sol.needs["alpha_d"] is None
    assert solve(buckets, target_b=0.35, alpha_p=sol.needs["alpha_p"]).feasible
    assert not solve(buckets, target_b=0.35, alpha_p=0.059).feasible
    assert solve(buckets, target_b=0.9).needs == {}  # feasible: nothing needed


def test_budget_spent_by_distortion_per_cost():
    # all floors R (B = base 0.1); target 0.1 + 0.2 leaves 0.2 to spend
    buckets = [
        B("big_bad", w=0.4, dl=0.01, dr=0.5),  # R->L: gain 0.49 / 0.125 = 3.92
        B("small_bad", w=0.1, dl=0.01, dr=0.5),  # R->L: 0.49 / 0.03125 = 15.7; R->H 0.5 / 0.1 = 5
        B("mild", w=0.2, dl=0.001, dr=0.05),  # R->L: 0.049 / 0.0625 = 0.78
    ]
    sol = solve(buckets, target_b=0.3, base_b=0.1)
    assert [(u["bucket"], u["to"]) for u in sol.upgrades][:2] == [("small_bad", "L"), ("big_bad", "L")]
    assert sol.expected_b <= 0.3 + 1e-12
    ratios = [u["ratio"] for u in sol.upgrades]
    assert sol.upgrades[0]["ratio"] == max(ratios)
    assert sol.actions["small_bad"] in ("L", "H") and sol.actions["big_bad"] == "L"


def test_zero_gain_upgrades_not_taken_and_budget_is_an_upper_bound():
    sol = solve([B("a", w=0.5, dl=0.0, dr=0.0)], target_b=1.0)
    assert sol.actions == {"a": "R"} and sol.expected_b == 0.0


def test_expected_b_counts_base_and_l_cost():
    buckets = [B("a", w=0.5), B("b", w=0.3)]
    assert expected_b({"a": "L", "b": "H"}, buckets, base_b=0.2) == pytest.approx(0.2 + 0.5 * 0.3125 + 0.3)
    assert expected_b({"a": "L", "b": "R"}, buckets, l_cost=0.15625) == pytest.approx(0.5 * 0.15625)


def test_ties_break_by_name():
    sol = solve([B("b", w=0.1), B("a", w=0.1)], target_b=0.04)
    assert sol.upgrades[0]["bucket"] == "a"


# -- properties -----------------------------------------------------------------------------------
_v = st.floats(min_value=-0.05, max_value=0.2, allow_nan=False)
_d = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)


@st.composite
def instances(draw):
    n = draw(st.integers(1, 8))
    buckets = [
        BucketInput(
            f"q{i}",
            draw(st.sampled_from("PD")),
            draw(st.floats(0.0, 0.2, allow_nan=False)),
            v={"L": draw(_v), "R": draw(_v), **({"L2": draw(_v)} if four else {})},
            d={"L": draw(_d), "R": draw(_d), **({"L2": draw(_d)} if four else {})},
        )
        for i in range(n)
        for four in [draw(st.booleans())]
    ]
    base = draw(st.floats(0.0, 0.2, allow_nan=False))
    target = draw(st.floats(0.0, 1.0, allow_nan=False))
    return buckets, base, target


@settings(max_examples=200, deadline=None)
@given(instances())
def test_solver_properties(inst):
    buckets, base, target = inst
    sol = solve(buckets, target, base_b=base)
    by = {b.bucket: b for b in buckets}
    for name, act in sol.actions.items():
        b = by[name]
        alpha = 0.02 if b.stage == "P" else 0.05
        # floors respected: never cheaper than the floor; the floor itself is within tolerance
        assert ORDER.index(act) >= ORDER.index(sol.floors[name])
        assert sol.v_eff[name][sol.floors[name]] <= alpha
        # the floor is the cheapest such action
        cheaper = ORDER[: ORDER.index(sol.floors[name])]
        assert all(sol.v_eff[name][a] > alpha for a in cheaper)
        assert sol.v_eff[name]["R"] >= sol.v_eff[name]["L"]  # monotone
        if "L2" in b.v:
            assert sol.v_eff[name]["R"] >= sol.v_eff[name]["L2"] >= sol.v_eff[name]["L"]
        else:
            assert act != "L2" and sol.floors[name] != "L2"
    assert sol.expected_b == pytest.approx(expected_b(sol.actions, buckets, base))
    if sol.feasible:
        assert sol.expected_b <= target + 1e-9
        # greedy: no remaining single upgrade both fits and reduces distortion
        for b in buckets:
            cur = sol.actions[b.bucket]
            for new in ORDER[ORDER.index(cur) + 1 :]:
                added = b.weight * (cost(new) - cost(cur))
                gain = sol.d_eff[b.bucket][cur] - sol.d_eff[b.bucket][new]
                assert not (gain > 0 and sol.expected_b + added <= target - 1e-9)
        # upgrades were taken in non-increasing order of gain per cost only when all were available:
        # each taken upgrade was the best fitting one at its time (replay check)
        _replay_greedy(buckets, sol, target, base)
    else:
        assert sol.actions == sol.floors and sol.floor_b > target


def _replay_greedy(buckets, sol, target, base):
    actions = dict(sol.floors)
    b_now = expected_b(actions, buckets, base)
    for u in sol.upgrades:
        best = -1.0
        for b in buckets:
            cur = actions[b.bucket]
            for new in ORDER[ORDER.index(cur) + 1 :]:
                added = b.weight * (cost(new) - cost(cur))
                gain = sol.d_eff[b.bucket][cur] - sol.d_eff[b.bucket][new]
                if gain > 0 and b_now + added <= target + 1e-12:
                    best = max(best, gain / added if added > 0 else math.inf)
        assert u["ratio"] == pytest.approx(best)
        actions[u["bucket"]] = u["to"]
        b_now += u["added_b"]
    assert actions == sol.actions


# -- rule 5: fitting a target below the floors ----------------------------------------------------
def test_fit_sensitivity_relaxes_least_accuracy_per_byte_first():
    buckets = [
        B4("cheap_v", stage="P", w=0.4, vl=0.03, vl2=0.04, vr=0.06),  # floors H (alpha_P 0.02)
        B4("dear_v", stage="P", w=0.4, vl=0.3, vl2=0.4, vr=0.5),
    ]
    floors = solve(buckets, target_b=0.6)
    assert not floors.feasible and floors.actions == {"cheap_v": "H", "dear_v": "H"}
    sol = solve(buckets, target_b=0.6, fit="sensitivity")
    assert not sol.feasible and sol.fitted and sol.expected_b <= 0.6 + 1e-12
    # H->R of cheap_v: 0.06 / 0.4 = 0.15 per byte beats H->L (0.03 / 0.275 = 0.109)? no: L is cheaper in V per byte
    first = sol.relaxed[0]
    assert (first["bucket"], first["from"], first["to"]) == ("cheap_v", "H", "L")
    assert first["added_v"] == pytest.approx(0.03) and first["saved_b"] == pytest.approx(0.4 * 0.6875)
    assert sol.actions["dear_v"] == "H"  # never touched while cheap_v still had moves worth less
    assert sol.admitted["P"] == pytest.approx(sol.v_eff["cheap_v"][sol.actions["cheap_v"]])
    assert "FITTED by relaxing" in sol.summary()


def test_fit_ties_in_sensitivity_break_by_distortion():
    # a pooled item: both groups share V; distortion says group g1 is the safer one to relax
    buckets = [
        B4("item|g0", stage="P", w=0.5, vl=0.05, vl2=0.1, vr=0.2, dl=0.3, dl2=0.6, dr=0.9),
        B4("item|g1", stage="P", w=0.5, vl=0.05, vl2=0.1, vr=0.2, dl=0.01, dl2=0.02, dr=0.05),
    ]
    sol = solve(buckets, target_b=0.7, fit="sensitivity")
    assert sol.relaxed[0]["bucket"] == "item|g1" and sol.actions["item|g0"] == "H"


def test_fit_that_cannot_reach_the_target_says_so():
    buckets = [BucketInput("a", "P", 0.5, v={"L": 0.3}, d={"L": 0.1})]  # only L measured
    sol = solve(buckets, target_b=0.1, fit="sensitivity")
    assert not sol.fitted and sol.actions == {"a": "L"}
    assert sol.expected_b == pytest.approx(0.5 * 0.3125)
    assert "still does not fit" in sol.summary()


def test_fit_leaves_feasible_targets_alone():
    buckets = [B("a", w=0.3, dl=0.01, dr=0.4), B("b", w=0.2, vr=0.1, dl=0.02, dr=0.3)]
    a, b = solve(buckets, target_b=0.2), solve(buckets, target_b=0.2, fit="sensitivity")
    assert a.actions == b.actions and b.relaxed == [] and not b.fitted and b.feasible


def test_bad_fit_and_envelope_names_are_refused():
    with pytest.raises(ValueError, match="fit"):
        solve([B("a")], target_b=0.5, fit="budget")
    with pytest.raises(ValueError, match="envelope"):
        solve([B("a")], target_b=0.5, envelope_kind="tree")


def test_branch_envelope_leaves_release_and_int2_unordered():
    v = {"L": 0.01, "L2": 0.3, "R": 0.02}
    assert envelope(v, "branch") == {"H": 0.0, "L": 0.01, "L2": 0.3, "R": 0.02}
    assert envelope(v, "chain")["R"] == 0.3
    assert envelope({"L": 0.05, "L2": 0.0, "R": 0.0}, "branch") == {"H": 0.0, "L": 0.05, "L2": 0.05, "R": 0.05}
    # release within tolerance while INT2 is not: the branch floor is R, the chain floor L
    q = B4("q", vl=0.0, vl2=0.3, vr=0.02)
    assert solve([q], target_b=1.0, envelope_kind="branch").floors == {"q": "R"}
    assert solve([q], target_b=1.0).floors == {"q": "L"}


def test_upgrades_never_raise_sensitivity():
    # branch: R is allowed and harmless, INT2 harmful; a distortion gain alone must not buy INT2
    q = B4("q", w=0.5, vl=0.0, vl2=0.3, vr=0.01, dl=0.01, dl2=0.05, dr=0.2)
    sol = solve([q], target_b=0.5 * 0.1875, envelope_kind="branch")  # fits L2 but not L
    assert sol.actions == {"q": "R"} and sol.upgrades == []
    sol = solve([q], target_b=0.5, envelope_kind="branch")
    assert sol.actions["q"] in ("L", "H")


@settings(max_examples=200, deadline=None)
@given(instances(), st.sampled_from(["chain", "branch"]))
def test_fit_properties(inst, kind):
    buckets, base, target = inst
    sol = solve(buckets, target, base_b=base, fit="sensitivity", envelope_kind=kind)
    plain = solve(buckets, target, base_b=base, envelope_kind=kind)
    assert sol.feasible == plain.feasible and sol.floors == plain.floors
    assert sol.expected_b == pytest.approx(expected_b(sol.actions, buckets, base))
    if sol.feasible:
        assert sol.actions == plain.actions and not sol.relaxed
        return
    if sol.fitted:
        assert sol.expected_b <= target + 1e-9
    # every relaxation was the least added V per byte among the moves available at its time
    actions, b_now = dict(sol.floors), expected_b(sol.floors, buckets, base)
    for r in sol.relaxed:
        best = math.inf
        for b in buckets:
            cur = actions[b.bucket]
            for new in ORDER[: ORDER.index(cur)]:
                saved = b.weight * (cost(cur) - cost(new))
                if saved > 0 and math.isfinite(sol.v_eff[b.bucket][new]):
                    best = min(best, (sol.v_eff[b.bucket][new] - sol.v_eff[b.bucket][cur]) / saved)
        assert r["added_v"] / r["saved_b"] == pytest.approx(best, rel=1e-9, abs=1e-12)
        actions[r["bucket"]] = r["to"]
        b_now -= r["saved_b"]
        assert (b_now > target + 1e-12) == (r is not sol.relaxed[-1]) or not sol.fitted
    for b in buckets:  # upgrades after fitting never raise a bucket's effective sensitivity
        assert sol.v_eff[b.bucket][sol.actions[b.bucket]] <= max(sol.v_eff[b.bucket][actions[b.bucket]], 0) + 1e-12
