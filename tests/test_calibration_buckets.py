"""Bucket enumeration on synthetic control rows: token accounting, rare-item rule, weights; settings guard."""

from __future__ import annotations

import pytest

from pask.calibration.buckets import ControlRow, plan_buckets
from pask.calibration.calibrate import _check_settings, mismatch_stats
from pask.errors import PaskError

SCAF = "pure_scaffold|scaffold_separator|boundary|no_lookahead"
NAME = "schema_bearing|dispatch_key|critical|lookahead_critical"
VAL = "free_generation|required|critical|no_lookahead"


def _row(i, labels, tags, stop="grammar"):
    return ControlRow(f"c{i}", len(labels), len(tags), stop, tags, labels)


def test_stored_tokens_follow_the_stop_reason():
    assert _row(0, ["protected_content"] * 5, [SCAF] * 4).stored == 5 + 3  # last token never fed
    assert _row(0, ["protected_content"] * 5, [SCAF] * 4, stop="eos").stored == 5 + 4
    assert _row(0, ["protected_content"] * 5, [], stop="eos").stored == 5


def test_shares_window_and_rare_merge():
    # 100 prompt tokens + 21 generated (20 stored); window 8 covers the last 8 generated
    labels = ["protected_content"] * 60 + ["schema_scaffold"] * 37 + ["function_name"] * 2 + ["enum_constraint"]
    tags = [NAME] * 2 + [VAL] + [SCAF] * 18
    plan = plan_buckets([_row(0, labels, tags)], num_layers=30, num_groups=4, recent_window=8, min_share=0.01)
    shares = {it.name: it.share for it in plan.items}
    n = 120
    assert shares["P|protected_content"] == pytest.approx(60 / n)
    assert shares["P|schema_scaffold"] == pytest.approx(37 / n)
    assert shares["P|function_name"] == pytest.approx(2 / n)  # 1.7 % >= 1 %: own item
    # enum (1 token, 0.8 %) is rare and alone under 1 %: skipped (default action)
    assert "P|rare" not in shares and plan.skipped[0]["name"] == "P|enum_constraint"
    # decode: stored generated tokens outside the window = 20 - 8 = 12: NAME 2, VAL 1, SCAF 9
    assert shares[f"D|{NAME}"] == pytest.approx(2 / n) and shares[f"D|{SCAF}"] == pytest.approx(9 / n)
    assert f"D|{VAL}" not in shares and plan.skipped[1]["name"] == f"D|{VAL}"
    assert plan.window_share == pytest.approx(8 / n)
    assert sum(shares.values()) + plan.window_share + plan.unmeasured_share == pytest.approx(1.0)
    assert plan.group_weights == pytest.approx([8 / 30, 8 / 30, 7 / 30, 7 / 30])  # the cache's split
    weights = {name: w for name, _, _, w in plan.buckets()}
    assert weights["P|protected_content|g2"] == pytest.approx(60 / n * 7 / 30)
    assert plan.base_share() == pytest.approx(plan.unmeasured_share)


def test_rare_items_merge_when_together_they_matter():
    labels = ["protected_content"] * 90
    tags = [VAL, NAME] * 5 + [SCAF] * 9  # 19 generated, 18 stored, 10 outside the window
    plan = plan_buckets([_row(0, labels, tags)], 30, 4, 8, min_share=0.06)
    names = {it.name: it for it in plan.items}
    assert "D|rare" in names and sorted(names["D|rare"].members) == sorted([VAL, NAME])
    assert names["D|rare"].share == pytest.approx(10 / 108)
    assert plan.members("D|rare|g1") == [f"D|{m}|g1" for m in names["D|rare"].members]


def test_means_are_per_case_and_selection_is_checked():
    rows = [_row(0, ["protected_content"] * 10, [], "eos"), _row(1, ["schema_scaffold"] * 30, [], "eos")]
    plan = plan_buckets(rows, 4, 2, 0, min_share=0.0)
    assert {it.name: it.share for it in plan.items} == {"P|protected_content": 0.5, "P|schema_scaffold": 0.5}
    assert [n for n, *_ in plan_buckets(rows, 4, 2, 0, 0.0, select=["P|schema_scaffold|g1"]).buckets()] == [
        "P|schema_scaffold|g1"
    ]
    with pytest.raises(PaskError, match="unknown buckets"):
        plan_buckets(rows, 4, 2, 0, 0.0, select=["P|function_name|g0"])


def test_work_dir_settings_guard(tmp_path):
    _check_settings(tmp_path, {"a": 1, "cases": ["x"]})
    _check_settings(tmp_path, {"a": 1, "cases": ["x"]})  # same: resumes
    with pytest.raises(PaskError, match="cases differ"):
        _check_settings(tmp_path, {"a": 1, "cases": ["y"]})


def test_mismatch_stats():
    v = {f"q{i}": float(10 - i) for i in range(10)}  # q0 most sensitive
    d = {f"q{i}": float(i) for i in range(10)}  # distortion ranks them the other way round
    m = mismatch_stats(v, d)
    assert (m["k"], m["recall"], m["mismatch"]) == (2, 0.0, 1.0)
    m = mismatch_stats(v, v)
    assert (m["recall"], m["mismatch"]) == (1.0, 0.0)


def test_spaced_batches_for_distortion():
    from pask.calibration.distortion import spaced

    assert spaced([0, 1, 2], 1) == [1]  # the middle one, not the shortest prompts
    assert spaced(list(range(10)), 3) == [1, 5, 8]
    assert spaced([1, 2], None) == [1, 2] and spaced([1, 2], 5) == [1, 2]
    with pytest.raises(ValueError):
        spaced([1, 2], 0)


def test_pooled_members_cover_every_group():
    from pask.calibration.buckets import BucketPlan, Item

    plan = BucketPlan([Item("D|fn", "D", ["fn"], 0.2)], [0.25] * 4, 8, 0.1, 0.0)
    assert plan.pooled() == ["D|fn|all"]
    assert plan.members("D|fn|all") == [f"D|fn|g{g}" for g in range(4)]
    assert plan.members("D|fn|g2") == ["D|fn|g2"]
