"""benchmarks/compare_cells.py: paired counts, sign test and identical outputs against committed cells."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "benchmarks/compare_cells.py"
_SPEC = importlib.util.spec_from_file_location("compare_cells", SCRIPT)
cc = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(cc)


def _cell(d: Path, rows: list[tuple[str, bool, str]]) -> Path:
    d.mkdir(parents=True)
    lines = [
        {"id": i, "category": "simple", "correct": ok, "output": out, "calls": [], "budget": {"b_total": 0.3}}
        for i, ok, out in rows
    ]
    (d / "cases.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return d


def test_paired_counts_and_identical_outputs(tmp_path):
    new = _cell(tmp_path / "new", [("a", True, "x"), ("b", True, "y"), ("c", False, "z"), ("d", True, "w")])
    _cell(tmp_path / "cells" / "old", [("a", True, "x"), ("b", False, "y2"), ("c", True, "z2"), ("e", True, "q")])
    md = cc.compare([new], tmp_path / "cells")
    (row,) = [line for line in md.splitlines() if line.startswith("| old |")]
    cols = [c.strip() for c in row.strip("|").split("|")]
    # shared a, b, c: new right on a, b; old right on a, c; one identical output (a)
    assert cols[1] == "3" and cols[2] == "66.67" and cols[3] == "66.67"
    assert cols[4] == "1 : 1" and cols[5] == "1.000" and cols[8] == "1"


def test_by_name_pairs_each_cell_with_its_namesake_only(tmp_path):
    _cell(tmp_path / "new" / "full-b1", [("a", True, "x"), ("b", True, "y")])
    _cell(tmp_path / "new" / "h2o-b0.2", [("a", False, "p"), ("b", True, "q")])
    _cell(tmp_path / "new" / "only-new", [("a", True, "x")])
    _cell(tmp_path / "old" / "full-b1", [("a", True, "x"), ("b", False, "y2")])
    _cell(tmp_path / "old" / "h2o-b0.2", [("a", True, "p2"), ("b", True, "q")])
    md = cc.compare_by_name(tmp_path / "new", tmp_path / "old")
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.strip("|").split("|")] for r in md.splitlines()[4:]}
    assert set(rows) == {"full-b1", "h2o-b0.2"}  # no cross pairs, no cell without a namesake
    assert rows["full-b1"][4] == "1 : 0" and rows["full-b1"][8] == "1"
    assert rows["h2o-b0.2"][4] == "0 : 1" and rows["h2o-b0.2"][8] == "1"


def test_by_name_without_any_namesake_is_an_error(tmp_path):
    _cell(tmp_path / "new" / "a", [("a", True, "x")])
    _cell(tmp_path / "old" / "b", [("a", True, "x")])
    with pytest.raises(SystemExit, match="namesake"):
        cc.compare_by_name(tmp_path / "new", tmp_path / "old")
