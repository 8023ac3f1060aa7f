"""benchmarks/compare_cells.py: paired counts, sign test and identical outputs against committed cells."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

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
