"""Report: paper-layout tables, CSV and plots from (fabricated) result cells; deterministic output."""

from __future__ import annotations

import csv
import io
import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pask.cli import app
from pask.errors import PaskError
from pask.experiments.report import (
    CellResult,
    clusters,
    collect,
    csv_text,
    dodge,
    markdown,
    method_key,
    plot_accuracy_vs_budget,
    plot_category_bars,
    plot_sensitivity_vs_distortion,
    write_report,
    y_headroom,
)

PNG = b"\x89PNG\r\n\x1a\n"
BFCL = ("simple", "multiple", "parallel", "parallel_multiple")
SQL = ("easy", "medium", "hard", "extra")
MODEL = "qwen2.5-coder-0.5b"


def make_cell(root: Path, task: str, policy: str, budget: float | None, b: float, correct: list[int], **kw) -> Path:
    """A result cell as `pask sweep` lays it out; 10 cases per category / difficulty."""
    groups = BFCL if task == "bfcl" else SQL
    key, metric = ("categories", "accuracy") if task == "bfcl" else ("difficulties", "ex")
    per = {g: {"n": 10, "correct": c, metric: 10.0 * c} for g, c in zip(groups, correct, strict=True)}
    n, total = 10 * len(groups), sum(correct)
    summary = {key: per, "overall": {"n": n, "correct": total, metric: round(100 * total / n, 2)}, "measured_b": b}
    summary.update(kw.get("b_parts", {}))
    cell = root / MODEL / task / kw.get("split", "test") / f"{policy}-b{'1' if budget is None else f'{budget:g}'}"
    cell.mkdir(parents=True)
    (cell / "summary.json").write_text(json.dumps(summary))
    if "outcomes" in kw:
        rows = [{"id": f"c{i}", "correct": ok} for i, ok in enumerate(kw["outcomes"])]
        (cell / "cases.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"id": "torn')
    manifest = {"cell": {"model": MODEL, "task": task, "split": "test", "policy": policy, "budget": budget}}
    manifest.update({"status": kw.get("status", "done"), "n_cases": n, "wall_s": kw.get("wall", 1.0)})
    (cell / "cell.json").write_text(json.dumps(manifest))
    return cell


@pytest.fixture
def results(tmp_path) -> Path:
    root = tmp_path / "results"
    make_cell(root, "bfcl", "full", None, 1.0, [8, 7, 4, 3])
    make_cell(root, "bfcl", "pask", 0.33, 0.331, [8, 7, 3, 3])
    make_cell(root, "bfcl", "pask", 0.25, 0.252, [7, 6, 3, 2])
    make_cell(root, "bfcl", "h2o", 0.33, 0.334, [5, 5, 1, 1])
    make_cell(root, "bfcl", "snapkv", 0.33, 0.329, [6, 4, 2, 1])
    make_cell(root, "bfcl", "pask-prefill", 0.33, 0.61, [8, 7, 4, 2], b_parts={"measured_b_prompt": 0.2})
    make_cell(root, "bfcl", "pask-decode", 0.33, 0.72, [8, 7, 3, 3])
    make_cell(root, "sql", "full", None, 1.0, [6, 4, 2, 1])
    for budget in (0.6, 0.275):
        make_cell(root, "sql", "pask", budget, budget + 0.002, [6, 4, 1, 1])
        make_cell(root, "sql", "kivi-4", budget, budget - 0.001, [5, 3, 1, 0])
    return root


def table(md: str, title_part: str) -> list[str]:
    """The rows (header included) of the markdown table whose title contains ``title_part``."""
    lines = md.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("### ") and title_part in line)
    rows = []
    for line in lines[start + 1 :]:
        if line.startswith("### ") or line.startswith("## "):
            break
        if line.startswith("|") and not line.startswith("|---"):
            rows.append(line)
    return rows


def cells_of(row: str) -> list[str]:
    return [c.strip() for c in row.strip("|").split("|")]


def test_tables_in_paper_layouts(results):
    md = markdown(collect(results))
    t1 = [cells_of(r) for r in table(md, "Table 1 — BFCL accuracy (%) by category, B = 0.33")]
    assert t1[0] == ["Method", "B", "Simple", "Multiple", "Parallel", "Parallel multiple", "Overall", "n"]
    assert [r[0] for r in t1[1:]] == ["Full KV", "PASK", "H2O", "SnapKV"]  # reference first, then paper order
    assert t1[1][1:] == ["1.000", "80.00", "70.00", "40.00", "30.00", "55.00", "40"]
    assert t1[2][1] == "0.331" and t1[3][-2] == "30.00"
    t2 = [cells_of(r) for r in table(md, "Table 2 — Text-to-SQL EX (%) by budget")]
    assert t2 == [["Method", "B = 0.6", "B = 0.275"], ["PASK", "30.00 (0.602)", "30.00 (0.277)"],
                  ["KIVI-4", "22.50 (0.599)", "22.50 (0.274)"]]  # fmt: skip
    assert "Full KV: 32.50 (B = 1.000, n = 40)." in md
    t9 = [cells_of(r) for r in table(md, "Table 9 — target vs measured budget B (qwen2.5-coder-0.5b, BFCL")]
    assert t9[0] == ["Method", "target 0.33", "target 0.25", "max abs. deviation"]
    assert t9[1] == ["PASK", "0.331", "0.252", "0.002"] and [r[0] for r in t9[2:]] == ["H2O", "SnapKV"]
    t17 = [cells_of(r) for r in table(md, "Table 17 — PASK ablation at B = 0.33")]
    assert [r[0] for r in t17[1:]] == ["Full KV", "Prefill only", "Decode only", "Prefill + decode (PASK)"]
    assert t17[0][:4] == ["Variant", "B_P", "B_D", "B"] and t17[2][1:4] == ["0.200", "–", "0.610"]
    assert "Table 17" not in md.split("Text-to-SQL")[1]  # no ablation cells for SQL
    assert "Table 12 — Text-to-SQL EX (%) by difficulty, B = 0.6" in md


def test_csv_has_every_cell(results):
    rows = list(csv.DictReader(io.StringIO(csv_text(collect(results)))))
    assert len(rows) == 12
    pask = next(r for r in rows if r["task"] == "bfcl" and r["policy"] == "pask" and r["target_budget"] == "0.33")
    assert pask["measured_b"] == "0.3310" and pask["accuracy"] == "52.50" and pask["acc:parallel"] == "30.00"
    sql = next(r for r in rows if r["task"] == "sql" and r["policy"] == "kivi-4" and r["target_budget"] == "0.275")
    assert sql["acc:extra"] == "0.00" and sql["acc:simple"] == "" and sql["n"] == "40"


def test_report_is_deterministic(results, tmp_path):
    a = write_report(results, tmp_path / "a")
    b = write_report(results, tmp_path / "b")
    assert a.markdown.read_bytes() == b.markdown.read_bytes() and a.csv.read_bytes() == b.csv.read_bytes()
    copy = tmp_path / "copy"  # same results written in another order, other timings: same tables
    for cell in sorted((p.parent for p in results.rglob("summary.json")), reverse=True):
        dest = copy / cell.relative_to(results)
        shutil.copytree(cell, dest)
        man = json.loads((dest / "cell.json").read_text())
        (dest / "cell.json").write_text(json.dumps({**man, "wall_s": 99.0}))
    c = write_report(copy, tmp_path / "c")
    assert c.markdown.read_bytes() == a.markdown.read_bytes() and c.csv.read_bytes() == a.csv.read_bytes()
    assert {p.path.name for p in a.plots} == {p.path.name for p in c.plots}


def test_plots_are_pngs_with_the_expected_series(results, tmp_path):
    import matplotlib.image

    bfcl = [c for c in collect(results) if c.task == "bfcl"]
    fig3 = plot_accuracy_vs_budget(bfcl, tmp_path / "fig3.png")
    assert fig3.series == ["Full KV", "PASK", "H2O", "SnapKV"]
    bars = plot_category_bars(bfcl, tmp_path / "bars.png", budget=0.33)
    assert bars.series == ["Full KV", "PASK", "H2O", "SnapKV"]
    assert plot_category_bars(bfcl, tmp_path / "none.png", budget=0.9) is None  # no cell near B = 0.9
    for plot in (fig3, bars):
        assert plot.path.read_bytes()[:8] == PNG
        img = matplotlib.image.imread(plot.path)
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100


def _cell(policy: str, budget: float | None, b: float, acc: float) -> CellResult:
    return CellResult(MODEL, "bfcl", "test", policy, budget, b, 600, acc)


def test_dodge_spreads_only_coincident_points():
    points = [(0.33, 70.2), (0.331, 70.2), (0.334, 70.0), (0.33, 55.0), (0.5, 70.2)]
    assert clusters(points, x_tol=0.01, y_tol=1.0) == [[0, 1, 2], [3], [4]]
    offsets = dodge(points, x_tol=0.01, y_tol=1.0, step=0.02)
    assert offsets == pytest.approx([-0.02, 0.0, 0.02, 0.0, 0.0])  # centred on the group, input order
    assert dodge([(0.3, 50.0), (0.3, 50.0)], 0.01, 1.0, 0.02) == pytest.approx([-0.01, 0.01])
    # chained: a-b and b-c close, a-c not -> one group
    assert clusters([(0.30, 1.0), (0.309, 1.0), (0.318, 1.0)], 0.01, 1.0) == [[0, 1, 2]]
    assert dodge([], 0.01, 1.0, 0.02) == []


def test_y_headroom_leaves_room_above_the_reference():
    assert y_headroom(55.0) == pytest.approx(55.0 + 0.15 * 55.0)
    assert y_headroom(100.0) == pytest.approx(104.0)
    assert y_headroom(98.0) == pytest.approx(104.0)
    assert y_headroom(10.0) == pytest.approx(14.0)
    for top in (0.0, 20.0, 73.5, 99.9, 100.0):
        assert y_headroom(top) >= top + 4.0


@pytest.mark.parametrize(
    ("cells", "series"),
    [
        (  # one budget: labelled points, three of them on the same spot
            [_cell("full", None, 1.0, 73.5), _cell("pask", 0.33, 0.331, 70.2), _cell("kivi-4", 0.33, 0.333, 70.2),
             _cell("h2o", 0.33, 0.334, 55.0), _cell("snapkv", 0.33, 0.33, 70.0)],
            ["Full KV", "PASK", "H2O", "SnapKV", "KIVI-4"],
        ),
        (  # several budgets: curves, coincident at the top, Full KV at 100 %
            [_cell("full", None, 1.0, 100.0)]
            + [_cell(p, b, b + 0.001, a) for p, accs in (("pask", (99, 95, 90)), ("h2o", (99, 80, 60)))
               for b, a in zip((0.5, 0.33, 0.25), accs, strict=True)],
            ["Full KV", "PASK", "H2O"],
        ),
        ([_cell("pask", 0.33, 0.33, 40.0), _cell("pask", 0.25, 0.25, 30.0), _cell("h2o", 0.33, 0.33, 40.0)],
         ["PASK", "H2O"]),  # no Full KV; a curve and a lone point on one of its points
        ([_cell("full", None, 1.0, 60.0)], ["Full KV"]),
    ],
)  # fmt: skip
def test_accuracy_plot_shapes(cells, series, tmp_path):
    import matplotlib.image

    plot = plot_accuracy_vs_budget(cells, tmp_path / "fig3.png")
    assert plot.series == series
    assert plot.path.read_bytes()[:8] == PNG and matplotlib.image.imread(plot.path).ndim == 3
    with pytest.raises(PaskError, match="nothing to plot"):
        plot_accuracy_vs_budget([_cell("pask", 0.33, 0.33, None)], tmp_path / "none.png")


def test_calibration_scatter(tmp_path):
    import matplotlib.image

    buckets = [
        {"bucket": "P|schema_scaffold|g0", "V": {"L": 0.0, "R": 0.5}, "D": {"L": 0.01, "R": 0.3}},
        {"bucket": "D|x|g1", "V": {"L": 1.0, "R": 2.0}, "D": {"L": 0.02, "R": None}},
    ]
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"model": {"name": "m"}, "task": "bfcl", "calibration": {"buckets": buckets}}))
    plot = plot_sensitivity_vs_distortion(path, tmp_path / "fig9.png")
    assert plot.series == ["L (INT4)", "R (release)"]
    assert plot.path.read_bytes()[:8] == PNG and matplotlib.image.imread(plot.path).ndim == 3
    path.write_text(json.dumps({"actions": {}}))
    with pytest.raises(PaskError, match=r"no calibration\.buckets"):
        plot_sensitivity_vs_distortion(path, tmp_path / "x.png")
    with pytest.raises(PaskError, match="does not exist"):
        plot_sensitivity_vs_distortion(tmp_path / "missing.json", tmp_path / "x.png")


def test_unfinished_cells_are_marked(tmp_path):
    make_cell(tmp_path, "bfcl", "full", None, 1.0, [8, 7, 4, 3])
    make_cell(tmp_path, "bfcl", "h2o", 0.33, 0.33, [5, 5, 1, 1], status="running")
    md = markdown(collect(tmp_path))
    assert "| H2O * |" in md and "unfinished cell: qwen2.5-coder-0.5b/bfcl/test/h2o-b0.33" in md


def test_bad_inputs(tmp_path):
    with pytest.raises(PaskError, match="no result cells"):
        collect(tmp_path)
    with pytest.raises(PaskError, match="does not exist"):
        collect(tmp_path / "nope")
    cell = make_cell(tmp_path, "bfcl", "full", None, 1.0, [8, 7, 4, 3])
    with pytest.raises(PaskError, match=r"bars-budget"):
        write_report(tmp_path, tmp_path / "out", bars_budget=0.0)
    (cell / "summary.json").write_text("{not json")
    with pytest.raises(PaskError, match="not valid JSON"):
        collect(tmp_path)
    (cell / "summary.json").write_text(json.dumps({"measured_b": 1.0}))
    with pytest.raises(PaskError, match="without an 'overall' record"):
        collect(tmp_path)


def test_cli_report(results, tmp_path):
    runner = CliRunner()
    res = runner.invoke(app, ["report", str(results), "--out", str(tmp_path / "rep")])
    assert res.exit_code == 0, res.output
    assert "Table 1 — BFCL" in res.output and (tmp_path / "rep" / "cells.csv").exists()
    assert sorted(p.name for p in (tmp_path / "rep").glob("*.png")) == [
        "bars-qwen2.5_coder_0.5b-bfcl-test.png",
        "fig3-qwen2.5_coder_0.5b-bfcl-test.png",
        "fig3-qwen2.5_coder_0.5b-sql-test.png",
    ]
    empty = tmp_path / "empty"
    empty.mkdir()
    res = runner.invoke(app, ["report", str(empty)])
    assert res.exit_code == 2 and "no result cells" in res.output and "Traceback" not in res.output


def test_paired_comparison_counts_discordant_cases(tmp_path):
    from pask.experiments.report import sign_test_p

    root = tmp_path / "r"
    make_cell(root, "bfcl", "pask", 0.33, 0.33, [1, 1, 1, 1], outcomes=[True] * 6 + [False] * 4)
    make_cell(root, "bfcl", "kivi-4", 0.33, 0.34, [1, 1, 1, 1], outcomes=[True, False] * 5)
    make_cell(root, "bfcl", "h2o", 0.33, 0.33, [1, 1, 1, 1])  # no per-case rows: no paired row
    rows = [cells_of(r) for r in table(markdown(collect(root)), "Paired comparison with PASK at B = 0.33")]
    assert rows[0][:3] == ["Method", "n", "PASK only right"]
    # pask right on c0-c5; kivi right on c0, c2, c4, c6, c8 -> pask only c1, c3, c5; kivi only c6, c8
    assert rows[1:] == [["KIVI-4 (B = 0.340)", "10", "3", "2", "3", "2", "1.000"]]
    assert sign_test_p(0, 0) == 1.0 and sign_test_p(0, 6) == pytest.approx(2 / 64)
    assert sign_test_p(10, 0) < 0.01 and sign_test_p(3, 4) == sign_test_p(4, 3)


def test_paired_comparison_with_each_pask_variant(tmp_path):
    root = tmp_path / "r"
    make_cell(root, "bfcl", "pask", 0.2, 0.2, [1, 1, 1, 1], outcomes=[True] * 6 + [False] * 4)
    make_cell(root, "bfcl", "pask-k4v2", 0.2, 0.2, [1, 1, 1, 1], outcomes=[True] * 8 + [False] * 2)
    make_cell(root, "bfcl", "kivi-2", 0.2, 0.21, [1, 1, 1, 1], outcomes=[False] * 10)
    md = markdown(collect(root))
    k4 = [cells_of(r) for r in table(md, "Paired comparison with PASK (K4V2) at B = 0.2")]
    assert k4[0][2] == "PASK (K4V2) only right"
    # K4V2 right on c0-c7: PASK (right on c0-c5) never alone, KIVI-2 never right
    assert k4[1:] == [
        ["PASK (B = 0.200)", "10", "2", "0", "6", "2", "0.500"],
        ["KIVI-2 (B = 0.210)", "10", "8", "0", "0", "2", "0.008"],
    ]
    plain = [cells_of(r) for r in table(md, "Paired comparison with PASK at B = 0.2")]
    assert plain[1][0] == "PASK (K4V2) (B = 0.200)" and plain[1][2:4] == ["0", "2"]


def test_sql_ex_without_empty_gold_cases(tmp_path):
    root = tmp_path / "r"
    for policy, budget, ex_ne in (("full", None, 61.11), ("pask", 0.2, 52.78)):
        cell = make_cell(root, "sql", policy, budget, budget or 1.0, [6, 4, 2, 1])
        summary = json.loads((cell / "summary.json").read_text())
        summary["overall"].update(gold_empty=4, ex_nonempty_gold=ex_ne)
        (cell / "summary.json").write_text(json.dumps(summary))
    md = markdown(collect(root))
    rows = [cells_of(r) for r in table(md, "without the 4 cases whose gold returns no rows")]
    assert rows[1:] == [["PASK", "52.78 (0.200)"]]
    assert "Full KV: 61.11 (B = 1.000, n = 36)." in md
    bfcl = tmp_path / "b"
    make_cell(bfcl, "bfcl", "pask", 0.2, 0.2, [1, 1, 1, 1])
    assert "Table 2b" not in markdown(collect(bfcl))  # only where cells record it


def test_frontier_targets_name_the_best_baseline_and_significant_losses(tmp_path):
    root = tmp_path / "r"
    make_cell(root, "bfcl", "full", None, 1.0, [1, 1, 1, 1], outcomes=[True] * 30)
    make_cell(root, "bfcl", "pask-k4v2", 0.2, 0.201, [1, 1, 1, 1], outcomes=[True] * 20 + [False] * 10)
    make_cell(root, "bfcl", "kivi-2", 0.2, 0.21, [1, 1, 1, 1], outcomes=[True] * 5 + [False] * 25)
    make_cell(root, "bfcl", "snapkv", 0.2, 0.2, [1, 1, 1, 1], outcomes=[False] * 25 + [True] * 5)
    make_cell(root, "bfcl", "mikv", 0.2, 0.2, [0, 0, 0, 0], outcomes=[False] * 10 + [True] * 10 + [False] * 10)
    md = markdown(collect(root))
    rows = [cells_of(r) for r in table(md, "Frontier targets: PASK (K4V2)")]
    # best baseline by score (the fabricated summaries: KIVI-2 and SnapKV 10.00, MiKV 0): the
    # smaller B wins the tie; PASK is right on c0-c19, SnapKV on c25-c29
    assert rows[1][:3] == ["0.2", "10.00 (0.201)", "+0.00"]
    assert rows[1][3] == "0 : 10, p = 0.002"
    assert rows[1][4] == "SnapKV 10.00 (0.200)" and rows[1][6] == "20 : 5, p = 0.004"
    assert rows[1][7] == "none"
    make_cell(root, "bfcl", "h2o", 0.2, 0.2, [1, 1, 1, 1], outcomes=[True] * 30)
    rows = [cells_of(r) for r in table(markdown(collect(root)), "Frontier targets: PASK (K4V2)")]
    assert rows[1][7] == "H2O"  # right on all ten cases PASK misses: p = 0.002
    assert rows[1][8] == "–"
    make_cell(root, "bfcl", "kivi-mix", 0.2, 0.219, [2, 2, 2, 2], outcomes=[True] * 30)
    rows = [cells_of(r) for r in table(markdown(collect(root)), "Frontier targets: PASK (K4V2)")]
    assert rows[1][4].startswith("H2O") and rows[1][8] == "KIVI-4/2 mix 20.00 (0.219)"  # above 0.2 + 0.01


def test_report_says_when_cells_mix_code_versions(tmp_path):
    root = tmp_path / "r"
    for policy, budget, commit in (("full", None, "a" * 40), ("pask", 0.2, "b" * 40)):
        cell = make_cell(root, "bfcl", policy, budget, budget or 1.0, [1, 1, 1, 1])
        manifest = json.loads((cell / "cell.json").read_text())
        manifest["code_version"] = {"commit": commit, "dirty": policy == "pask"}
        manifest["runs"] = [{"machine": {"native_attention_isa": "avx512"}}]
        (cell / "cell.json").write_text(json.dumps(manifest))
    md = markdown(collect(root))
    assert "**This setting mixes code versions or machines**" in md
    assert "- aaaaaaa (avx512): Full KV" in md and "- bbbbbbb-dirty (avx512): PASK 0.2" in md
    one = tmp_path / "one"
    make_cell(one, "bfcl", "pask", 0.2, 0.2, [1, 1, 1, 1])
    assert "Every cell: code version ? , native kernels ?." not in markdown(collect(one))
    assert "Every cell: code version ?, native kernels ?." in markdown(collect(one))


def test_ruler_cells_report_the_recall_score_per_sub_task(tmp_path):
    """A task's own score (Task.score_key): RULER's recall score, not the share of all-correct cases."""
    root = tmp_path / "results"
    for policy, budget, score, acc in (
        ("full", None, 71.8, 50.0),
        ("snapkv", 0.2, 8.3, 0.0),
        ("fetch-snapkv", 0.2, 12.6, 0.0),
    ):
        cell = root / MODEL / "ruler" / "test" / f"{policy}-b{'1' if budget is None else f'{budget:g}'}"
        cell.mkdir(parents=True)
        per = {"niah_single": {"n": 2, "correct": 1, "score": score, "accuracy": acc}}
        summary = {
            "tasks": per,
            "overall": {"n": 2, "correct": 1, "score": score, "accuracy": acc},
            "measured_b": budget or 1.0,
        }
        (cell / "summary.json").write_text(json.dumps(summary))
        man = {
            "cell": {"model": MODEL, "task": "ruler", "split": "test", "policy": policy, "budget": budget},
            "status": "done",
        }
        (cell / "cell.json").write_text(json.dumps(man))
    cells = {c.policy: c for c in collect(root)}
    assert cells["fetch-snapkv"].accuracy == 12.6 and cells["snapkv"].groups == {"niah_single": 8.3}
    md = markdown(list(cells.values()))
    assert "RULER-style long context" in md and "SnapKV + KVFetch" in md and "12.60" in md


def test_kvfetch_table_pairs_each_fetch_cell_with_its_inner_policy(tmp_path):
    root = tmp_path / "results"
    make_cell(root, "bfcl", "full", None, 1.0, [8, 7, 4, 3])
    make_cell(root, "bfcl", "snapkv", 0.33, 0.33, [5, 5, 1, 1], outcomes=[False] * 30 + [True] * 10)
    cell = make_cell(
        root, "bfcl", "fetch-snapkv", 0.33, 0.328, [6, 6, 2, 1], outcomes=[True] * 5 + [False] * 25 + [True] * 10
    )
    rows = [json.loads(x) for x in (cell / "cases.jsonl").read_text().splitlines()[:-1]]
    for i, r in enumerate(rows):
        fires = 2 if i < 10 else 0
        r["budget"] = {
            "policy": {
                "kvfetch": {"steps": 10, "active_steps": 5 if fires else 0, "fires": fires, "fetched": 16 * fires}
            }
        }
    (cell / "cases.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    md = markdown(collect(root))
    lines = table(md, "KVFetch: each eviction policy")
    row = next(x for x in lines if "SnapKV + KVFetch" in x)
    # 5 cases only right with fetch, none only right without; 10 of 40 fired, 0.5 fires and 8 tokens per case
    assert (
        "| +7.50 |" in row and "5 : 0, p = 0.062" in row and "10 / 40" in row and "| 0.5 |" in row and "| 8.0 |" in row
    )
    assert "12.5 %" in row  # 50 of 400 steps had the pointer set


def test_a_policy_variant_is_its_own_method_paired_with_the_inner_policy(tmp_path):
    """A sweep variant (``cell.json``: policy + variant) is a method of its own, "<Method> [<variant>]",
    and a KVFetch variant is paired with its inner policy like the plain wrapper."""
    root = tmp_path / "results"
    make_cell(root, "bfcl", "full", None, 1.0, [8, 7, 4, 3])
    make_cell(root, "bfcl", "snapkv", 0.33, 0.33, [5, 5, 1, 1], outcomes=[False] * 30 + [True] * 10)
    make_cell(root, "bfcl", "fetch-snapkv", 0.33, 0.33, [5, 5, 1, 1], outcomes=[False] * 30 + [True] * 10)
    cell = make_cell(
        root, "bfcl", "fetch-snapkv~grammar", 0.33, 0.33, [6, 6, 2, 1], outcomes=[True] * 5 + [False] * 25 + [True] * 10
    )
    man = json.loads((cell / "cell.json").read_text())
    man["cell"] |= {"policy": "fetch-snapkv", "variant": "grammar"}
    (cell / "cell.json").write_text(json.dumps(man))
    cells = {c.policy: c for c in collect(root)}
    assert cells["fetch-snapkv~grammar"].method == "SnapKV + KVFetch [grammar]"
    assert cells["fetch-snapkv"].method == "SnapKV + KVFetch"
    md = markdown(list(cells.values()))
    rows = table(md, "KVFetch: each eviction policy")
    var = next(x for x in rows if "SnapKV + KVFetch [grammar]" in x)
    assert "| +7.50 |" in var and "5 : 0, p = 0.062" in var  # paired with SnapKV, not with fetch-snapkv
    order = [c.policy for c in sorted(cells.values(), key=lambda c: method_key(c.policy))]
    assert order.index("fetch-snapkv~grammar") == order.index("fetch-snapkv") + 1
