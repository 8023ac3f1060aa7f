"""Screened sensitivity (pask.calibration.screening): which cases the probes run and how V weighs them."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pask.calibration.buckets import ControlRow
from pask.calibration.screening import screen_all, screen_control_correct
from pask.calibration.sensitivity import run_sensitivity
from pask.errors import PaskError


def test_unscreened_v_is_the_plain_accuracy_difference_gains_included():
    s = screen_all(["a", "b", "c", "d"], pool=5)  # a fifth case was a schema error, never run
    ctrl = {"a": True, "b": True, "c": False, "d": False}
    probe = {"a": False, "b": True, "c": True, "d": False}
    assert not s.screened and s.resolution == pytest.approx(0.2)
    assert s.v(ctrl, probe) == pytest.approx((2 - 2) / 5)
    assert s.v(ctrl, {}) == pytest.approx(2 / 5)  # missing rows count as wrong


def test_screen_spreads_probes_by_control_correct_counts_and_weighs_flips_by_group():
    # simple: 6 of 8 right, parallel: 2 of 8 right; 4 probes -> 3 simple + 1 parallel
    ids = [f"s{i}" for i in range(8)] + [f"p{i}" for i in range(8)]
    correct = {i: (i[0] == "s" and int(i[1:]) < 6) or i in ("p3", "p5") for i in ids}
    groups = {i: "simple" if i[0] == "s" else "parallel" for i in ids}
    s = screen_control_correct(correct, groups, pool=16, probes=4)
    assert s.screened and s.case_ids == ["s0", "s1", "s2", "p3"]  # first correct cases in split order
    assert s.weights["s0"] == pytest.approx(6 / (16 * 3)) and s.weights["p3"] == pytest.approx(2 / 16)
    assert s.resolution == pytest.approx(2 / 16)
    assert s.groups == {
        "simple": {"control_correct": 6, "probed": 3, "weight": pytest.approx(6 / 48)},
        "parallel": {"control_correct": 2, "probed": 1, "weight": pytest.approx(2 / 16)},
    }
    assert sum(s.weights.values()) == pytest.approx(8 / 16)  # every probe flips -> V = control accuracy
    # one simple flip stands for 2 of the 6 right simple cases: 2/16 of the pool
    assert s.v(correct, {"s1": True, "s2": True, "p3": True}) == pytest.approx(2 / 16)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from("abc"), st.booleans()), min_size=1, max_size=40),
    st.integers(1, 50),
    st.integers(0, 5),
)
def test_screen_properties(cases, probes, schema_errors):
    ids = [f"x{i}" for i in range(len(cases))]
    correct = {i: ok for i, (_, ok) in zip(ids, cases, strict=True)}
    groups = {i: g for i, (g, _) in zip(ids, cases, strict=True)}
    pool = len(ids) + schema_errors
    k = sum(correct.values())
    if k == 0:
        with pytest.raises(PaskError, match="no case right"):
            screen_control_correct(correct, groups, pool, probes)
        return
    s = screen_control_correct(correct, groups, pool, probes)
    k_of = {g: sum(correct[i] for i in ids if groups[i] == g) for g in set(groups.values())}
    n_groups = sum(1 for v in k_of.values() if v)
    assert len(s.weights) == min(max(probes, n_groups), k) and all(correct[i] for i in s.weights)
    assert sum(s.weights.values()) == pytest.approx(k / pool)
    p_of = {g: sum(groups[i] == g for i in s.weights) for g in k_of}
    for g, kg in k_of.items():
        right = [i for i in ids if groups[i] == g and correct[i]]
        assert [i for i in s.case_ids if groups[i] == g] == right[: p_of[g]]  # a prefix of the group's right cases
        assert (p_of[g] >= 1) == (kg >= 1)
        for h, kh in k_of.items():  # D'Hondt: moving a probe from h to g would not lower g's weight below h's
            if p_of[h] > 1 and kg and p_of[g] < kg:
                assert kg / p_of[g] <= kh / (p_of[h] - 1) + 1e-9
    assert s.v(correct, correct) == 0 and s.v(correct, {}) == pytest.approx(k / pool)


def test_bad_screens_are_clear_errors():
    with pytest.raises(PaskError, match="--probe-cases must be >= 1"):
        screen_control_correct({"a": True}, {"a": "g"}, 1, 0)
    with pytest.raises(PaskError, match="no case right"):
        screen_control_correct({"a": False}, {"a": "g"}, 1, 3)


def test_screened_sensitivity_runs_only_the_probed_cases_and_weighs_their_flips(tmp_path):
    cases = [SimpleNamespace(id=f"c{i}", category="simple" if i < 4 else "parallel") for i in range(8)]
    right = {"c0", "c1", "c2", "c4"}
    rows = [ControlRow(c.id, 10, 5, "eos", None, None, None, c.id in right) for c in cases]
    control = SimpleNamespace(rows=rows, summary={"overall": {"n": 8, "correct": 4}})
    plan = SimpleNamespace(members=lambda b: [b], num_groups=4, recent_window=8)
    groups = {c.id: c.category for c in cases}
    screen = screen_control_correct({r.id: r.correct for r in rows}, groups, 8, probes=2)
    assert screen.case_ids == ["c0", "c4"]
    seen = []

    def run(lm, run_cases, out_dir, *args):
        seen.append([c.id for c in run_cases])
        out_dir.mkdir(parents=True, exist_ok=True)
        with open(out_dir / "cases.jsonl", "w") as f:
            for c in run_cases:  # the probe breaks the parallel case only
                f.write(json.dumps({"id": c.id, "correct": c.category == "simple"}) + "\n")
        n_right = sum(c.category == "simple" for c in run_cases)
        return {"overall": {"correct": n_right, "n": len(run_cases)}, "measured_b": 0.5}

    task = SimpleNamespace(name="bfcl", run=run)
    lm = SimpleNamespace(name="fake", fingerprint="fp")
    recs, n_run = run_sensitivity(
        lm, cases, control, plan, [("P|function_name|g0", "R")], tmp_path, task=task, screen=screen
    )
    assert n_run == 1 and seen == [["c0", "c4"]]
    assert recs[("P|function_name|g0", "R")]["v"] == pytest.approx(1 / 8)  # the only right parallel case lost
    again, n_again = run_sensitivity(
        lm, cases, control, plan, [("P|function_name|g0", "R")], tmp_path, task=task, screen=screen
    )
    assert n_again == 0 and again[("P|function_name|g0", "R")]["v"] == pytest.approx(1 / 8)  # resumed from the JSONL
