"""benchmarks/frontier_gap.py (items, admitted harm, the exhaustive bound) and benchmarks/sql_glue.py."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location("frontier_gap", Path(__file__).parents[1] / "benchmarks/frontier_gap.py")
fg = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(fg)


def _table(tmp_path: Path) -> Path:
    def bucket(item, g, w, v, floor, action):
        return {"bucket": f"{item}|g{g}", "weight": w, "V": v, "floor": floor, "action": action}

    big = {"L": 0.01, "L2": 0.02, "R": 0.30}
    cheap = {"L": 0.0, "L2": 0.0, "R": 0.05}
    buckets = [bucket("P|a", g, 0.3, big, "L", "L2") for g in range(2)]
    buckets += [bucket("P|b", g, 0.2, cheap, "H", "R") for g in range(2)]
    table = {"target_b": 0.2, "expected_b": 0.2, "l2_key_bits": 4, "calibration": {"buckets": buckets}}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(table))
    return path


def _cell(root: Path, name: str, outcomes: list[bool], b: float) -> Path:
    cell = root / name
    cell.mkdir()
    rows = [{"id": f"c{i}", "correct": ok} for i, ok in enumerate(outcomes)]
    (cell / "cases.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    acc = 100 * sum(outcomes) / len(outcomes)
    (cell / "summary.json").write_text(json.dumps({"overall": {"accuracy": acc, "n": len(outcomes)}, "measured_b": b}))
    return cell


def test_items_pool_groups_and_charge_what_lies_below_the_floor(tmp_path):
    rows = fg.items(json.loads(_table(tmp_path).read_text()))
    assert [r["item"] for r in rows] == ["P|a", "P|b"] and rows[0]["weight"] == pytest.approx(0.6)
    assert fg.admitted(rows[0]) == pytest.approx(0.02)  # L2 below its floor L
    assert fg.admitted(rows[1]) == pytest.approx(0.05)  # released below H
    # within 0.6 * 0.25 + 0: a at K4V2, b released (0.07); releasing a instead would cost 0.30
    v, actions = fg.best_uniform(rows, {**fg.COST, "L2": 0.25}, 0.15)
    assert v == pytest.approx(0.07) and actions == {"P|a": "L2", "P|b": "R"}
    v, actions = fg.best_uniform(rows, {**fg.COST, "L2": 0.25}, 0.01)
    assert actions == {"P|a": "R", "P|b": "R"} and v == pytest.approx(0.35)


def test_gap_reports_predicted_and_measured_loss(tmp_path):
    full = _cell(tmp_path, "full", [True] * 8 + [False] * 2, 1.0)
    pask = _cell(tmp_path, "pask", [True] * 6 + [False] * 3 + [True], 0.2)
    data, md = fg.gap(_table(tmp_path), pask, full)
    assert data["paired"] == [1, 2] and data["measured_loss"] == pytest.approx(10.0)
    assert data["admitted_v"] == pytest.approx(0.07) and data["predicted_loss"] == pytest.approx(5.6)
    assert "`P / a`" in md and "| L2 | L2 |" in md


def test_cli_refuses_a_missing_cell(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        fg.main(["--full", str(tmp_path), f"{_table(tmp_path)}={tmp_path / 'nope'}"])
    assert e.value.code == 2 and "TABLE.json=CELL_DIR" in capsys.readouterr().err


def test_sql_glue_finds_a_keyword_glued_to_the_next_word():
    spec = importlib.util.spec_from_file_location("sql_glue", Path(__file__).parents[1] / "benchmarks/sql_glue.py")
    sg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sg)
    assert sg.glued("SELECT Name FROM people WHERENationality = 'x'", "poker_player") == "WHERENationality"
    assert sg.glued("SELECT Name FROM people ORDERBY Name", "poker_player") == "ORDERBY"
    assert sg.glued("SELECT Name FROM people ORDER BY Name LIMIT 1", "poker_player") is None
    assert sg.glued("SELECT Name FROM people WHERE Name = 'WHERENationality'", "poker_player") is None
